"""Metrics of SPEC 9: data, timing, throughput, gradient-variance proxy, staleness, MoE, spec-decode.

Each function returns a flat ``{name: float}`` dict with TensorBoard-ready names.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from nemo_dapo.algo.loss import masked_mean


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def data_metrics(scores: torch.Tensor, rewards: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                 prompt_lengths: torch.Tensor, max_response_length: int, max_prompt_length: int,
                 aborted: torch.Tensor | None = None) -> dict[str, float]:
    """Score / reward / advantage and length statistics over the non-aborted samples.

    ``scores`` and ``rewards`` are per-sequence sums; ``advantages`` is [B, T] (its valid
    tokens are averaged); ``aborted`` marks samples the engine aborted (excluded).
    """
    alive = torch.ones(scores.shape[0], dtype=torch.bool) if aborted is None else ~aborted.bool()
    response_lengths = response_mask.sum(dim=-1).float()
    valid_adv = advantages[alive][response_mask[alive].bool()]
    metrics = {
        **_stats("critic/score", scores[alive]),
        **_stats("critic/rewards", rewards[alive]),
        **_stats("critic/advantages", valid_adv),
        **_stats("response_length", response_lengths[alive]),
        **_stats("prompt_length", prompt_lengths[alive].float()),
        "response_length/clip_ratio": (response_lengths[alive] >= max_response_length).float().mean().item()
        if alive.any() else 0.0,
        "prompt_length/clip_ratio": (prompt_lengths[alive] >= max_prompt_length).float().mean().item()
        if alive.any() else 0.0,
        "response/aborted_ratio": 1.0 - alive.float().mean().item(),
    }
    return metrics


def timing_metrics(timings_s: Mapping[str, float], num_response_tokens: int, num_total_tokens: int) -> dict[str, float]:
    """Seconds per stage and ms per token: generation over response tokens, the rest over all."""
    metrics = {}
    for stage, seconds in timings_s.items():
        metrics[f"timing_s/{stage}"] = seconds
        tokens = num_response_tokens if stage == "gen" else num_total_tokens
        metrics[f"timing_per_token_ms/{stage}"] = 1000.0 * seconds / max(tokens, 1)
    return metrics


def throughput_metrics(num_total_tokens: int, step_seconds: float, num_gpus: int) -> dict[str, float]:
    """Tokens per second per device (``num_gpus`` = accelerators, or processes on CPU)."""
    return {
        "perf/total_num_tokens": float(num_total_tokens),
        "perf/time_per_step": step_seconds,
        "perf/throughput": num_total_tokens / max(step_seconds, 1e-9) / max(num_gpus, 1),
    }


def variance_proxy_metrics(advantages: torch.Tensor, old_log_prob: torch.Tensor, sum_sq_probs: torch.Tensor,
                           response_mask: torch.Tensor, grad_norm: float | None = None,
                           is_weights: torch.Tensor | None = None) -> dict[str, float]:
    """Policy-gradient variance proxy.

    ``q = ||e_t - p||^2 = 1 - 2 p_t + sum_v p_v^2`` is the squared norm of the score function
    of a token w.r.t. the logits (``p_t`` from the old policy). Total power is
    ``E[w^2 A^2 q]`` off-policy (with IS weights) or ``E[A^2 q]`` on-policy; the signal is the
    squared gradient norm of the update.
    """
    q = 1.0 - 2.0 * torch.exp(old_log_prob) + sum_sq_probs
    power = advantages.square() * q
    if is_weights is not None:
        power = power * is_weights.square()
    metrics = {"variance_proxy/total_power": masked_mean(power, response_mask).item()}
    if grad_norm is not None:
        metrics["variance_proxy/signal"] = float(grad_norm) ** 2
    return metrics


def staleness_metrics(min_versions: Sequence[int], max_versions: Sequence[int], current_version: int) -> dict[str, float]:
    """Per trajectory: versions spanned (max-min+1) and lag behind the current policy.

    The lag lower bound uses the newest version that contributed tokens, the worst case the
    oldest one.
    """
    low = torch.as_tensor(min_versions, dtype=torch.float64)
    high = torch.as_tensor(max_versions, dtype=torch.float64)
    return {
        **_stats("staleness/versions_spanned", high - low + 1),
        **_stats("staleness/lag_lower_bound", current_version - high),
        **_stats("staleness/lag_worst_case", current_version - low),
    }


class ExpertLoadTracker:
    """Routed-expert token counts per MoE layer, accumulated over response tokens until logged."""

    def __init__(self) -> None:
        self._counts: torch.Tensor | None = None

    def add(self, counts: torch.Tensor) -> None:
        """``counts``: [num_layers, num_experts] tokens routed to each expert."""
        counts = counts.detach().double()
        self._counts = counts.clone() if self._counts is None else self._counts + counts

    def report(self) -> dict[str, float]:
        """Imbalance per layer (max load / mean load; 1.0 is perfect), then reset."""
        if self._counts is None:
            return {}
        counts, self._counts = self._counts, None
        imbalance = counts.max(dim=-1).values / counts.mean(dim=-1).clamp(min=1e-9)
        metrics = {f"moe/layer_{i}_load_imbalance": v.item() for i, v in enumerate(imbalance)}
        metrics["moe/load_imbalance_max"] = imbalance.max().item()
        metrics["moe/load_imbalance_mean"] = imbalance.mean().item()
        return metrics


def spec_decode_metrics(num_draft_tokens: int | None, num_accepted_tokens: int | None,
                        num_verify_steps: int | None) -> dict[str, float]:
    """Acceptance rate and mean acceptance length, only when all three counts exist."""
    if num_draft_tokens is None or num_accepted_tokens is None or num_verify_steps is None:
        return {}
    return {
        "spec_decode/acceptance_rate": num_accepted_tokens / max(num_draft_tokens, 1),
        "spec_decode/acceptance_length": 1.0 + num_accepted_tokens / max(num_verify_steps, 1),
    }


def reduce_metrics(metric_lists: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Reduce lists gathered over micro-batches / ranks: mean, or max/min for keys naming them."""
    reduced = {}
    for name, values in metric_lists.items():
        tensor = torch.as_tensor([float(v) for v in values], dtype=torch.float64)
        if tensor.numel() == 0:
            continue
        leaf = name.rsplit("/", 1)[-1]
        if "max" in leaf:
            reduced[name] = tensor.max().item()
        elif "min" in leaf:
            reduced[name] = tensor.min().item()
        else:
            reduced[name] = tensor.mean().item()
    return reduced


def append_metrics(store: dict[str, list], metrics: Mapping[str, float]) -> None:
    """Collect one micro-batch's metrics into ``store`` for :func:`reduce_metrics`."""
    for name, value in metrics.items():
        store.setdefault(name, []).append(value)
