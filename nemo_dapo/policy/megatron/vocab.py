"""Log-probs and entropy from vocabulary-parallel logits, never gathering a full-vocabulary row.

Each tensor-parallel rank holds ``V / TP`` columns of the logits (the output layer's shard).
Gathering them would put ``tokens x V`` fp32 values on every rank (16k tokens x 152k vocab is
10 GB per copy); here every rank keeps its own columns and the softmax statistics are
all-reduced over the TP group. Equal to :mod:`nemo_dapo.algo.logprob` on the gathered logits
(tested at TP = 2 with a padded vocabulary).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from nemo_dapo.algo.logprob import chunked_token_stats


def vocab_parallel_stats(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits / T)[labels]`` and the entropy of ``softmax(logits / T)``, per position.

    ``logits``: this rank's ``[..., V_padded / TP]`` columns; columns at or past ``vocab_size``
    (padding to a multiple of TP) are left out. Both results carry gradients to the logits (the
    entropy only with ``entropy_grad``; without, it is a metric and keeps no graph).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_sum

    start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    shifted = logits[..., : max(0, min(logits.shape[-1], vocab_size - start))].float() / temperature
    with torch.no_grad():  # log-softmax does not depend on the shift: no gradient through it
        peak = shifted.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = shifted - peak.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_sum(exp.sum(dim=-1))
    log_norm = sum_exp.log()
    local = labels - start
    in_shard = (local >= 0) & (local < shifted.shape[-1])
    # advanced indexing keeps only the indices for its backward (gather would keep ``shifted``)
    rows = shifted.reshape(-1, shifted.shape[-1])
    picked = rows[torch.arange(rows.shape[0]), local.clamp(0, shifted.shape[-1] - 1).reshape(-1)].view(local.shape)
    log_probs = reduce_sum(torch.where(in_shard, picked, torch.zeros_like(picked))) - log_norm
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = log_norm - reduce_sum((exp * shifted).sum(dim=-1)) / sum_exp
    return log_probs, entropy


class DeferredOutputLayer:
    """Makes GPTModel's ``output_layer`` hand back its input, so that the model returns its final
    hidden states instead of logits; :meth:`response_stats` then applies the real layer chunk by
    chunk (:func:`~nemo_dapo.algo.logprob.chunked_token_stats`) at the response positions only.

    GPTModel calls ``output_layer(hidden, weight=..., runtime_gather_output=...)`` and returns the
    first result as [b, s, ...]: here [b, s, hidden], never [b, s, vocab / TP]. Only the instance's
    ``forward`` is replaced: the module, its parameter names, checkpoints, DDP hooks and weight
    export are untouched. With sequence parallelism the hidden states are gathered over TP here and
    the layer runs without its own gather (its input-gradient all-reduce then sums the gradient,
    which the gather's backward splits back), as Megatron does for its last-token logits. That
    path needs TransformerEngine and is not run on CPU.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer: Any = layer  # megatron's ColumnParallelLinear (its sequence_parallel flag is toggled)
        self.sequence_parallel = bool(getattr(layer, "sequence_parallel", False))
        self._weight: torch.Tensor | None = None
        layer.forward = self._hand_back_hidden

    def _hand_back_hidden(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        self._weight = weight  # the embedding's weight when input and output embeddings are tied
        return hidden, None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's ``[..., V_padded / TP]`` logit columns of ``hidden`` (the real layer)."""
        self.layer.sequence_parallel = False  # already gathered
        try:
            return type(self.layer).forward(self.layer, hidden, weight=self._weight)[0]
        finally:
            self.layer.sequence_parallel = self.sequence_parallel

    def response_stats(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        vocab_size: int,
        entropy_grad: bool,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`vocab_parallel_stats` of ``logits(hidden)``, ``chunk_tokens`` positions at a time."""
        stats = functools.partial(
            vocab_parallel_stats, temperature=temperature, vocab_size=vocab_size, entropy_grad=entropy_grad
        )
        return chunked_token_stats(hidden, labels, self.logits, stats, chunk_tokens)
