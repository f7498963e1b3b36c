"""KL penalty estimators and KL coefficient controllers (docs/algorithm.md §4).

With ``d = lp - ref_lp`` per token: ``k1`` = d, ``abs`` = |d|, ``k2`` = d^2 / 2, ``k3`` =
``exp(-d) + d - 1`` (Schulman's low-variance unbiased estimator, clamped to [-10, 10]).
A trailing ``+`` keeps the value of the base estimator but takes the gradient of k2
(straight-through), because k2's gradient is the unbiased KL gradient while k1/k3 are not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nemo_dapo.algo import metric_names as mn

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0

_ALIASES = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
    "full": "full",
}
KL_PENALTY_NAMES = tuple(sorted(set(_ALIASES) | {name + "+" for name in _ALIASES if name != "full"}))


def _base_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, base: str) -> torch.Tensor:
    diff = log_prob - ref_log_prob
    if base == "k1":
        return diff
    if base == "abs":
        return diff.abs()
    if base == "k2":
        return 0.5 * diff.square()
    if base == "k3":
        ref_minus_lp = torch.clamp(-diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(ref_minus_lp) - ref_minus_lp - 1.0, -K3_CLAMP, K3_CLAMP)
    raise NotImplementedError(
        "kl_penalty='full' needs the full vocabulary distributions, which are not materialised; "
        "use k1, abs, k2 or k3 (optionally with '+')"
    )


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference policy."""
    straight_through = kind.endswith("+")
    base_name = kind[:-1] if straight_through else kind
    if base_name not in _ALIASES or (straight_through and base_name == "full"):
        raise ValueError(f"kl penalty {kind!r} is unknown; choose one of {list(KL_PENALTY_NAMES)}")
    base = _ALIASES[base_name]
    value = _base_estimate(log_prob, ref_log_prob, base)
    if not straight_through or base == "k2":
        return value
    k2 = _base_estimate(log_prob, ref_log_prob, "k2")
    return k2 - k2.detach() + value.detach()


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Fixed: nothing to adapt."""


@dataclass
class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards ``target_kl``.

    ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon`` (Ziegler et al.).
    """

    value: float
    target_kl: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target_kl <= 0 or self.horizon <= 0:
            raise ValueError("algorithm.kl_ctrl: adaptive control needs target_kl > 0 and horizon > 0")

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            raise ValueError(f"adaptive KL controller got a non-finite KL {current_kl}")
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def build_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r}: choose 'fixed' or 'adaptive'")


def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    controller,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """``rewards = scores - beta * KL`` per token, then adapt beta to the batch's mean KL."""
    kld = kl_penalty(log_prob, ref_log_prob, kind).detach() * response_mask
    rewards = token_level_scores - controller.value * kld
    tokens = response_mask.sum(dim=-1).clamp(min=1)
    current_kl = ((kld.sum(dim=-1) / tokens).mean()).item()
    metrics = {mn.REWARD_KL_PENALTY.name: current_kl, mn.REWARD_KL_PENALTY_COEFF.name: controller.value}
    controller.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, metrics
