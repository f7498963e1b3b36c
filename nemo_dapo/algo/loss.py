"""Loss aggregation and the bypass-mode REINFORCE loss (docs/algorithm.md: loss aggregation).

The policy losses (:mod:`nemo_dapo.algo.policy_losses`) and the one here build a per-token
loss matrix that :func:`aggregate_loss` turns into a scalar. Aggregation takes optional
*global* denominators (token / sequence counts over the whole mini-batch and all
data-parallel ranks): with them, summing the gradients of all micro-batches and ranks gives
exactly the gradient of the un-split mini-batch, whatever the micro-batch size or layout.
The reference recipe averages per micro-batch and rescales, which is exact only with one
micro-batch on one rank.
"""

from __future__ import annotations

from enum import Enum

import torch

LOG_RATIO_CLAMP = 20.0


class LossAggMode(str, Enum):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


LOSS_AGG_MODES = tuple(mode.value for mode in LossAggMode)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set; masked entries never leak NaN/inf."""
    zeros = torch.zeros_like(values)
    picked = torch.where(mask.bool(), values, zeros)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over masked entries; 0 (not NaN) when nothing is masked in."""
    count = mask.float().sum() if dim is None else mask.float().sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str | LossAggMode = LossAggMode.TOKEN_MEAN,
    *,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar (docs/algorithm.md §2).

    - ``token-mean``: sum(L * mask) / N_tokens.
    - ``seq-mean-token-sum``: sum over non-empty rows of the row's token sum / N_seqs.
    - ``seq-mean-token-mean``: sum over non-empty rows of the row's token mean / N_seqs.
    - ``seq-mean-token-sum-norm``: sum(L * mask) / norm_constant (default: padded T).

    ``N_tokens`` / ``N_seqs`` default to this batch's counts; pass the counts over the whole
    mini-batch (all micro-batches, all DP ranks) to make the split exact; the workers then sum
    (not average) the gradients over ranks.
    Fully masked rows count in no denominator and yield no NaN.
    """
    mode = LossAggMode(mode)
    mask = mask.to(loss_mat.dtype)
    if mode is LossAggMode.TOKEN_MEAN:
        count = mask.sum() if global_token_count is None else global_token_count
        loss = masked_sum(loss_mat, mask) / _at_least_one(count)
    elif mode is LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        constant = loss_mat.shape[-1] if norm_constant is None else norm_constant
        loss = masked_sum(loss_mat, mask) / constant
    else:
        tokens_per_row = mask.sum(dim=-1)
        row_sums = masked_sum(loss_mat, mask, dim=-1)
        if mode is LossAggMode.SEQ_MEAN_TOKEN_MEAN:
            row_sums = row_sums / tokens_per_row.clamp(min=1.0)
        non_empty = (tokens_per_row > 0).to(loss_mat.dtype)
        count = non_empty.sum() if global_seq_count is None else global_seq_count
        loss = (row_sums * non_empty).sum() / _at_least_one(count)
    return loss


def _at_least_one(count) -> torch.Tensor:
    return torch.as_tensor(count, dtype=torch.float32).clamp(min=1.0)
