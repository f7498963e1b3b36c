"""Metrics of docs/algorithm.md §9: data, timing, throughput and staleness.

Each function returns a flat ``{name: float}`` dict; the names and how they combine are
declared in :mod:`nemo_dapo.algo.metric_names`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nemo_dapo.algo import metric_names as mn


def _stats(family: dict[str, mn.Metric], values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {m.name: 0.0 for m in family.values()}
    return {
        family["mean"].name: values.mean().item(),
        family["max"].name: values.max().item(),
        family["min"].name: values.min().item(),
    }


def data_metrics(
    scores: torch.Tensor,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    prompt_lengths: torch.Tensor,
    max_response_length: int,
    max_prompt_length: int,
    aborted: torch.Tensor | None = None,
) -> dict[str, float]:
    """Score / reward / advantage and length statistics over the non-aborted samples.

    ``scores`` and ``rewards`` are per-sequence sums; ``advantages`` is [B, T] (its valid
    tokens are averaged); ``aborted`` marks samples the engine aborted (excluded).
    """
    alive = torch.ones(scores.shape[0], dtype=torch.bool) if aborted is None else ~aborted.bool()
    response_lengths = response_mask.sum(dim=-1).float()
    valid_adv = advantages[alive][response_mask[alive].bool()]
    metrics = {
        **_stats(mn.SCORE, scores[alive]),
        **_stats(mn.REWARDS, rewards[alive]),
        **_stats(mn.ADVANTAGES, valid_adv),
        **_stats(mn.RESPONSE_LENGTH, response_lengths[alive]),
        **_stats(mn.PROMPT_LENGTH, prompt_lengths[alive].float()),
        mn.RESPONSE_CLIP_RATIO.name: (response_lengths[alive] >= max_response_length).float().mean().item()
        if alive.any()
        else 0.0,
        mn.PROMPT_CLIP_RATIO.name: (prompt_lengths[alive] >= max_prompt_length).float().mean().item()
        if alive.any()
        else 0.0,
        mn.ABORTED_RATIO.name: 1.0 - alive.float().mean().item(),
    }
    return metrics


def timing_metrics(timings_s: Mapping[str, float], num_response_tokens: int, num_total_tokens: int) -> dict[str, float]:
    """Seconds per stage and ms per token: generation over response tokens, the rest over all."""
    metrics = {}
    for stage, seconds in timings_s.items():
        metrics[mn.TIMING_S.of(stage=stage)] = seconds
        tokens = num_response_tokens if stage == "gen" else num_total_tokens
        metrics[mn.TIMING_PER_TOKEN_MS.of(stage=stage)] = 1000.0 * seconds / max(tokens, 1)
    return metrics


def throughput_metrics(num_total_tokens: int, step_seconds: float, num_gpus: int) -> dict[str, float]:
    """Tokens per second per device (``num_gpus`` = accelerators, or processes on CPU)."""
    return {
        mn.TOTAL_NUM_TOKENS.name: float(num_total_tokens),
        mn.TIME_PER_STEP.name: step_seconds,
        mn.THROUGHPUT.name: num_total_tokens / max(step_seconds, 1e-9) / max(num_gpus, 1),
    }


def staleness_metrics(versions: Sequence[int], current_version: int) -> dict[str, float]:
    """How many policy versions each trajectory lags behind the policy it trains, counted from the
    version that drew its first token: ``current_version - version``, 0 is on-policy (the
    per-token lag of a trajectory that spans a weight update is :func:`token_staleness_metrics`'s).
    """
    return _stats(mn.STALENESS_LAG, current_version - torch.as_tensor(versions, dtype=torch.float64))


def token_staleness_metrics(token_versions: torch.Tensor, mask: torch.Tensor, current_version: int) -> dict[str, float]:
    """Streaming: the lag of every response token (``token_versions``, [B, R]) behind the policy
    that trains on it, and the share of samples drawn by more than one version."""
    drawn = mask.bool()
    metrics = _stats(mn.TOKEN_LAG, (current_version - token_versions[drawn]).to(torch.float64))
    lowest = torch.where(drawn, token_versions, token_versions.max() + 1).min(dim=1).values
    highest = torch.where(drawn, token_versions, token_versions.min() - 1).max(dim=1).values
    metrics[mn.PARTIAL_SHARE.name] = float((highest > lowest).float().mean())
    return metrics
