"""Log-probs and entropy from vocabulary-parallel logits, never gathering a full-vocabulary row.

Each tensor-parallel rank holds ``V / TP`` columns of the logits (the output layer's shard).
Gathering them would put ``tokens x V`` fp32 values on every rank (16k tokens x 152k vocab is
10 GB per copy); here every rank keeps its own columns and the softmax statistics are
all-reduced over the TP group. Equal to :mod:`nemo_dapo.algo.logprob` on the gathered logits
(tested at TP = 2 with a padded vocabulary).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int,
                         entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
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
