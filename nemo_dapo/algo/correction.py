"""Rollout (off-policy) correction between the generation and training policies (docs/algorithm.md §7).

The engine that sampled a response (vLLM, maybe with stale weights) is not exactly the
policy being trained, so ``log r = old_lp - rollout_lp`` is not zero. Correction either
re-weights tokens (truncated importance sampling) or rejects tokens / sequences whose
mismatch is too large, and always reports how large the mismatch was.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.loss import masked_mean, masked_sum
from nemo_dapo.errors import ConfigError

LOG_RATIO_CLAMP = 20.0
IS_LEVELS = (None, "token", "sequence")
RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_STATS = ("k1", "k2", "k3")
LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclass(frozen=True)
class CorrectionSettings:
    """The knobs of docs/algorithm.md §7 (the config schema mirrors these names)."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None  # comma list of "<level>_<stat>", e.g. "seq_mean_k1,token_k3"
    rollout_rs_threshold: str | float | None = None  # one per mode: "lower_upper" for k1, upper for k2/k3
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"


PRESETS: dict[str, CorrectionSettings] = {
    "decoupled_token_is": CorrectionSettings(rollout_is="token", rollout_is_threshold=2.0),
    "decoupled_seq_is": CorrectionSettings(rollout_is="sequence", rollout_is_threshold=2.0),
    "decoupled_geo_rs": CorrectionSettings(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "bypass_ppo_clip": CorrectionSettings(bypass_mode=True, loss_type="ppo_clip"),
    "bypass_pg_is": CorrectionSettings(
        rollout_is="sequence", rollout_is_threshold=2.0, bypass_mode=True, loss_type="reinforce"
    ),
}


def preset(name: str, **overrides) -> CorrectionSettings:
    if name not in PRESETS:
        raise ConfigError(f"algorithm.rollout_correction.preset={name!r}: choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def correction_settings(section) -> CorrectionSettings:
    """The effective settings of ``algorithm.rollout_correction`` (the config's section, or any
    object with its fields): the preset's, then every field set (not null) on top; ``rollout_is:
    none`` turns a preset's weights off."""
    base = preset(section.preset) if section.preset else CorrectionSettings()
    chosen = {
        name: getattr(section, name)
        for name in CorrectionSettings.__dataclass_fields__
        if getattr(section, name) is not None
    }
    if chosen.get("rollout_is") == "none":
        chosen["rollout_is"] = None
    return replace(base, **chosen)


def rollout_log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log r = old_lp - rollout_lp``, clamped to +-20 and zero outside the mask."""
    log_ratio = torch.clamp(old_log_prob - rollout_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio)).detach()


def is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str | None,
    threshold: float = 2.0,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Truncated IS weights: ``token`` w_t = r_t, ``sequence`` w = prod_t r_t (broadcast).

    Truncated above at ``threshold`` and detached; ``batch_normalize`` rescales the valid
    weights to mean 1. Level ``None`` returns no weights (metrics only).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r}: choose one of {IS_LEVELS}")
    if level is None:
        return None, {}
    if threshold <= 0:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold={threshold}: must be > 0")
    if level == "token":
        raw = torch.exp(log_ratio)
    else:
        seq_log = torch.clamp(masked_sum(log_ratio, mask, dim=-1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        raw = torch.exp(seq_log).unsqueeze(-1).expand_as(log_ratio)
    weights = torch.clamp(raw, max=threshold)
    if batch_normalize:
        weights = weights / masked_mean(weights, mask).clamp(min=1e-8)
    weights = (weights * mask).detach()
    metrics = {
        mn.IS_WEIGHT["mean"].name: masked_mean(weights, mask).item(),
        mn.IS_WEIGHT["max"].name: _masked_extreme(weights, mask, torch.max),
        mn.IS_WEIGHT["min"].name: _masked_extreme(weights, mask, torch.min),
        mn.IS_TRUNCATED.name: masked_mean((raw > threshold).float(), mask).item(),
    }
    return weights, metrics


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, reduce) -> float:
    picked = values[mask.bool()]
    return reduce(picked).item() if picked.numel() else 0.0


def _token_statistic(log_ratio: torch.Tensor, stat: str) -> torch.Tensor:
    if stat == "k1":
        return -log_ratio
    if stat == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(log_ratio) - 1.0 - log_ratio


def parse_rs_modes(modes: str | None, thresholds) -> list[tuple[str, str, float, float]]:
    """``"seq_mean_k1,token_k3"`` + ``"0.999_1.001,0.5"`` -> [(level, stat, low, high), ...]."""
    if not modes:
        return []
    names = [m.strip() for m in str(modes).split(",") if m.strip()]
    bounds = [b.strip() for b in str(thresholds).split(",")] if thresholds is not None else []
    if len(bounds) != len(names):
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs={modes!r} needs one threshold per mode in "
            f"rollout_rs_threshold (got {thresholds!r}): 'lower_upper' ratio range for k1, an upper bound for k2/k3"
        )
    return [_parse_rs_mode(name, bound) for name, bound in zip(names, bounds)]


def _parse_rs_mode(name: str, bound: str) -> tuple[str, str, float, float]:
    level, _, stat = name.rpartition("_")
    if level not in RS_LEVELS or stat not in RS_STATS:
        raise ValueError(f"rollout_rs mode {name!r}: expected <level>_<stat>, level in {RS_LEVELS}, stat in {RS_STATS}")
    try:
        if stat == "k1":
            low, high = (float(x) for x in bound.split("_"))
        else:
            low, high = float("-inf"), float(bound)
    except ValueError as err:
        # YAML reads an unquoted 0.5_2 as the number 0.52 (underscores group digits): say so
        hint = "; YAML read a number here: quote 'lower_upper' or write both with a point (0.5_2.0)"
        raise ValueError(
            f"rollout_rs threshold {bound!r} for {name}: k1 takes 'lower_upper' "
            "(a ratio range such as 0.999_1.001), k2/k3 a positive number" + (hint if "_" not in bound else "")
        ) from err
    if (stat == "k1" and not 0 < low < high) or (stat != "k1" and high <= 0):
        raise ValueError(f"rollout_rs threshold {bound!r} for {name}: k1 needs 0 < lower < upper, k2/k3 upper > 0")
    return level, stat, low, high


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, modes) -> tuple[torch.Tensor, dict[str, float]]:
    """Drop tokens (``token_*``) or whole sequences (``seq_*``) whose mismatch is out of bounds.

    k1 bounds apply to the ratio ``exp(agg log r)`` (token: r_t; seq_sum: prod r_t; seq_mean:
    geometric mean; seq_max: every token's r_t); k2/k3 bounds to ``agg k(log r)`` (sum, mean or
    max over the sequence). Several modes combine: a token survives only if all accept it.
    """
    keep = mask.bool().clone()
    metrics: dict[str, float] = {}
    for level, stat, low, high in modes:
        accepted = _accepted(log_ratio, mask, level, stat, low, high)
        metrics[mn.RS_MODE_REJECTED.of(mode=f"{level}_{stat}")] = masked_mean((~accepted).float(), mask).item()
        keep &= accepted
    if modes:
        metrics[mn.RS_REJECTED.name] = masked_mean((~keep).float(), mask).item()
    return keep.to(mask.dtype), metrics


def _accepted(log_ratio, mask, level, stat, low, high) -> torch.Tensor:
    if stat == "k1":
        value = log_ratio
        low, high = torch.log(torch.tensor(low)), torch.log(torch.tensor(high))
    else:
        value = _token_statistic(log_ratio, stat)
    if level == "token":
        return (value >= low) & (value <= high)
    if level == "seq_max":
        inside = ((value >= low) & (value <= high)) | ~mask.bool()
        return inside.all(dim=-1, keepdim=True).expand_as(mask)
    agg = masked_sum(value, mask, dim=-1) if level == "seq_sum" else masked_mean(value, mask, dim=-1)
    inside = (agg >= low) & (agg <= high)
    return inside.unsqueeze(-1).expand_as(mask)


def mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the training policy is from the engine that generated the batch."""
    gap = (old_log_prob - rollout_log_prob).abs()
    log_ratio = rollout_log_ratio(old_log_prob, rollout_log_prob, mask)
    return {
        mn.LOGPROB_DIFF_MEAN.name: masked_mean(gap, mask).item(),
        mn.LOGPROB_DIFF_MAX.name: _masked_extreme(gap, mask, torch.max),
        mn.ROLLOUT_KL_K1.name: masked_mean(-log_ratio, mask).item(),
        mn.ROLLOUT_KL_K3.name: masked_mean(_token_statistic(log_ratio, "k3"), mask).item(),
    }


def apply_rollout_correction(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, settings: CorrectionSettings
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights (or None), the loss mask after rejection, and all mismatch metrics.

    Decoupled mode passes the recomputed old policy's log-probs, once per batch. Bypass mode
    (``old_lp := rollout_lp``) passes the actor's current log-probs (detached) from inside the
    loss, so the weights measure the current policy against the engine that sampled.
    """
    log_ratio = rollout_log_ratio(old_log_prob, rollout_log_prob, mask)
    modes = parse_rs_modes(settings.rollout_rs, settings.rollout_rs_threshold)
    new_mask, rs_metrics = rejection_mask(log_ratio, mask, modes)
    weights, is_metrics = is_weights(
        log_ratio, new_mask, settings.rollout_is, settings.rollout_is_threshold, settings.rollout_is_batch_normalize
    )
    return weights, new_mask, {**mismatch_metrics(old_log_prob, rollout_log_prob, mask), **rs_metrics, **is_metrics}
