"""Log-probabilities and entropy from logits: the quantities every worker must agree on."""

from __future__ import annotations

import torch


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


def sum_squared_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``sum_v p_v^2`` per position, needed by the gradient-variance proxy (SPEC 9)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return (probs * probs).sum(dim=-1)
