"""Log-probabilities and entropy from logits: the quantities every worker must agree on."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[labels]`` per position.

    The rollout engine samples from ``softmax(logits / T)``; the trainer must score the same
    distribution or the importance ratios are off by the temperature.
    """
    scaled = logits.float() / temperature
    log_norm = torch.logsumexp(scaled, dim=-1)
    picked = torch.gather(scaled, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - log_norm


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy ``logsumexp(z) - sum softmax(z) * z`` of the token distribution."""
    scaled = logits.float() / temperature
    probs = torch.softmax(scaled, dim=-1)
    return torch.logsumexp(scaled, dim=-1) - (probs * scaled).sum(dim=-1)


def token_stats(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)`` of full-vocabulary logits, equal to :func:`log_probs_from_logits`
    and :func:`entropy_from_logits` but from one log-softmax: three passes over the vocabulary
    instead of about ten, which on a CPU cost as much as the output layer's matmul.
    ``entropy_grad=False``: the entropy is a metric (no entropy bonus), so it keeps no graph and
    its backward over the vocabulary is skipped."""
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    log_p = torch.log_softmax(scaled, dim=-1)
    picked = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return picked, entropy


# Bytes one chunk's fp32 logits may take. The backward of a chunk holds about four tensors of
# this size (logits, softmax, their gradients), so 128 MiB chunks peak near 0.5 GiB whatever the
# micro-batch size: 682 tokens a chunk at SmolLM2's 49k vocabulary, 220 at Qwen's 152k.
LOGITS_CHUNK_BYTES = 128 << 20


def chunk_tokens_for(vocab_columns: int, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits fit ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_columns))


def chunked_token_stats(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    stats: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``stats(head(hidden), labels)`` computed ``chunk_tokens`` positions at a time.

    A whole micro-batch's ``[tokens, vocab]`` logits never exist: each chunk's logits are made,
    reduced to two numbers per token and dropped. With gradients on, every chunk runs under
    activation checkpointing, so the backward keeps only the chunk's input (a view of ``hidden``)
    and makes the chunk's logits again when it reaches it: one extra output-layer matmul per
    token buys memory that no longer grows with the micro-batch or the vocabulary. The results
    and gradients equal the unchunked computation (up to float summation order). ``head`` and
    ``stats`` may hold collectives (tensor-parallel output layer): every rank runs the same chunks
    in the same order, forward and backward.
    """
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    grad = torch.is_grad_enabled()

    def one_chunk(part: torch.Tensor, part_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return stats(head(part), part_labels)

    log_probs, entropy = [], []
    # no positions still runs one empty chunk: its results stay attached to the graph, so every rank
    # of a context-parallel group back-propagates (and meets its peers' collectives) alike
    for start in range(0, max(flat_labels.shape[0], 1), chunk_tokens):
        args = (flat_hidden[start : start + chunk_tokens], flat_labels[start : start + chunk_tokens])
        part_lp, part_ent = checkpoint(one_chunk, *args, use_reentrant=False) if grad else one_chunk(*args)
        log_probs.append(part_lp)
        entropy.append(part_ent)
    return torch.cat(log_probs).view(labels.shape), torch.cat(entropy).view(labels.shape)
