"""Advantage estimators, registered by name (docs/algorithm.md §3).

An estimator is called as ``est(token_level_rewards=..., response_mask=..., group_ids=...,
norm_adv_by_std=True, epsilon=1e-6)`` and returns ``(advantages, returns)``, both [B, T]
and zero outside the response mask. ``group_ids`` holds one hashable id per sequence: the
prompt the sequence answers, so its group baseline is the other answers to that prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from enum import Enum

import torch

from nemo_dapo.algo.batch import group_rows

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class AdvantageEstimator(str, Enum):
    GRPO = "grpo"
    GRPO_VECTORIZED = "grpo_vectorized"


_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_adv_est(name: str | AdvantageEstimator) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator that makes an estimator available to ``get_advantage_estimator(name)``."""
    key = name.value if isinstance(name, AdvantageEstimator) else str(name)

    def register(fn: AdvantageFn) -> AdvantageFn:
        if key in _ESTIMATORS and _ESTIMATORS[key] is not fn:
            raise ValueError(f"advantage estimator {key!r} is already registered")
        _ESTIMATORS[key] = fn
        return fn

    return register


def get_advantage_estimator(name: str | AdvantageEstimator) -> AdvantageFn:
    key = name.value if isinstance(name, AdvantageEstimator) else str(name)
    if key not in _ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={key!r} is unknown; registered: {sorted(_ESTIMATORS)}")
    return _ESTIMATORS[key]


def registered_estimators() -> list[str]:
    return sorted(_ESTIMATORS)


def group_index(group_ids: Sequence[Hashable]) -> tuple[torch.Tensor, int]:
    """Map hashable group ids to dense integers 0..G-1 in first-appearance order."""
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(gid, len(dense)) for gid in group_ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def _broadcast(scores: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = scores.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``A_i = (s_i - mean_g) / (std_g + eps)`` with the unbiased std of the group.

    ``s_i`` is the sum of the sequence's token rewards. A group of one has mean 0 and std 1,
    so a lone answer keeps its raw score rather than a meaningless zero.
    """
    scores = token_level_rewards.sum(dim=-1).float()
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {scores.shape[0]} sequences")
    normalised = torch.empty_like(scores)
    for rows in group_rows(group_ids).values():
        group = scores[rows]
        if len(rows) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = group.mean(), group.std(unbiased=True)
        centred = group - mean
        normalised[rows] = centred / (std + epsilon) if norm_adv_by_std else centred
    return _broadcast(normalised, response_mask)


@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)
def compute_grpo_vectorized_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO with segment sums instead of a Python loop over groups (large batches).

    Same result as :func:`compute_grpo_advantage` except that the variance is floored at
    ``epsilon`` before the square root, which only matters for near-constant groups.
    """
    scores = token_level_rewards.sum(dim=-1).float()
    index, num_groups = group_index(group_ids)
    counts = torch.zeros(num_groups).index_add_(0, index, torch.ones_like(scores))
    sums = torch.zeros(num_groups).index_add_(0, index, scores)
    singleton = counts == 1
    means = torch.where(singleton, torch.zeros_like(sums), sums / counts)
    centred = scores - means[index]
    squared = torch.zeros(num_groups).index_add_(0, index, (scores - (sums / counts)[index]) ** 2)
    variances = squared / (counts - 1).clamp(min=1.0)
    stds = torch.where(singleton, torch.ones_like(variances), variances.clamp(min=epsilon).sqrt())
    normalised = centred / (stds[index] + epsilon) if norm_adv_by_std else centred
    return _broadcast(normalised, response_mask)
