"""The policy-loss family, chosen by name (``actor.policy_loss``), like the advantage estimators.

Every loss maps per-token log-probs of the current and the old policy, advantages and the
loss mask to a ``[B, T]`` loss matrix and reduces it with :func:`~nemo_dapo.algo.loss.aggregate_loss`,
so the global-count exactness across micro-batches and data-parallel ranks holds for each of
them. Sequence-level losses (GSPO, GMPO) put their row loss on each of the row's tokens and
reduce with ``seq-mean-token-mean``: a row is never split between micro-batches or ranks (a
context-parallel rank sees the whole row's log-probs), so the row loss is exact too.

Built in (docs/algorithm.md §1 gives their formulas):

- ``dapo``: decoupled clip (clip-higher) with dual clip, the DAPO paper's loss (arXiv 2503.14476).
- ``gspo`` / ``gspo_token``: sequence-level ratio from the length-normalised log-ratio (GSPO,
  arXiv 2507.18071).
- ``cispo``: clipped, stop-gradient IS weight times the log-prob (MiniMax-M1, arXiv 2506.13585).
- ``gmpo``: geometric mean of the token ratios, clipped per token in log space (GMPO, arXiv 2507.20673).

Every loss has one signature, ``loss(old_log_prob, log_prob, advantages, mask, settings) ->
(loss, metrics)``, with :class:`PolicyLossSettings` carrying the clip range, the aggregation and
its global counts, and the rollout IS weights; ``settings.aggregate(loss_matrix, mask)`` reduces
the matrix split-exactly. Your own loss, without editing the library: decorate it with
``@register_policy_loss("name")`` in a module of yours and set ``actor.policy_loss:
"your.module:name"``; every worker imports the module, which registers the loss, then looks the
name up.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nemo_dapo.algo.loss import LOG_RATIO_CLAMP, LOSS_AGG_MODES, aggregate_loss, masked_mean, masked_sum

SEQUENCE_LEVEL = ("seq-mean-token-mean",)


@dataclass(frozen=True)
class PolicyLossSettings:
    """What a policy loss reads besides the four tensors: the clip range (``actor.clip_ratio_*``),
    the aggregation with this batch's global counts (so micro-batches and data-parallel ranks add
    up to the whole batch's loss), and the rollout-correction IS weights (detached; None: 1)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 10.0
    loss_agg_mode: str = "token-mean"
    global_token_count: float | torch.Tensor | None = None
    global_seq_count: float | torch.Tensor | None = None
    norm_constant: float | None = None
    is_weights: torch.Tensor | None = None

    def aggregate(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The IS-weighted loss matrix reduced with :func:`~nemo_dapo.algo.loss.aggregate_loss`."""
        weighted = loss_mat if self.is_weights is None else loss_mat * self.is_weights.detach()
        return aggregate_loss(
            weighted,
            mask,
            self.loss_agg_mode,
            global_token_count=self.global_token_count,
            global_seq_count=self.global_seq_count,
            norm_constant=self.norm_constant,
        )


LossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossSettings], tuple[torch.Tensor, dict[str, float]]
]


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    fn: LossFn
    loss_agg_modes: tuple[str, ...]  # the aggregations the loss is defined for


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, loss_agg_modes: tuple[str, ...] = LOSS_AGG_MODES):
    """Decorator: make ``fn(old_log_prob, log_prob, advantages, mask, settings) -> (loss, metrics)``
    available as ``actor.policy_loss: name``; reduce its loss matrix with ``settings.aggregate``."""
    unknown = set(loss_agg_modes) - set(LOSS_AGG_MODES)
    if unknown:
        raise ValueError(f"policy loss {name!r}: unknown loss_agg_modes {sorted(unknown)}; known: {LOSS_AGG_MODES}")

    def register(fn):
        POLICY_LOSSES[name] = PolicyLoss(name, fn, tuple(loss_agg_modes))
        return fn

    return register


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss; ``module:name`` imports ``module`` first (it registers ``name``)."""
    module, _, registered = name.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(f"actor.policy_loss={name!r}: cannot import {module!r} ({error})") from error
    if registered not in POLICY_LOSSES:
        raise ValueError(
            f"actor.policy_loss={name!r} is not a registered policy loss; known: "
            f"{sorted(POLICY_LOSSES)} (or 'your.module:name', registered with @register_policy_loss)"
        )
    return POLICY_LOSSES[registered]


def policy_loss_problems(name: str, loss_agg_mode: str) -> list[str]:
    """Start-up check: the loss exists and is defined for the aggregation."""
    try:
        loss = get_policy_loss(name)
    except ValueError as error:
        return [str(error)]
    if loss_agg_mode not in loss.loss_agg_modes:
        return [
            f"actor.policy_loss={name} is defined for actor.loss_agg_mode in {list(loss.loss_agg_modes)}, "
            f"not {loss_agg_mode!r}: set actor.loss_agg_mode={loss.loss_agg_modes[0]}"
        ]
    return []


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's masked tokens, [B]; 0 for a fully masked row."""
    return masked_sum(values, mask, dim=-1) / mask.float().sum(dim=-1).clamp(min=1.0)


def _pessimistic(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float):
    """PPO's ``max(-A r, -A clip(r, 1-low, 1+high))`` and where the clipped branch wins."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("dapo")
def dapo_loss(old_log_prob, log_prob, advantages, mask, settings: PolicyLossSettings):
    """Decoupled-clip PPO loss with dual clip (DAPO, arXiv 2503.14476; dual clip: arXiv 1912.09729).

    ``r = exp(clamp(lp - old_lp, -20, 20))``; ``C1 = max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``;
    where ``A < 0`` the loss is further capped at ``-A * clip_ratio_c``, so a huge ratio on a bad
    token cannot dominate the update. Rollout IS weights multiply the per-token loss. Metrics:
    ``pg_clipfrac``, ``pg_clipfrac_lower`` (dual clip active), ``ppo_kl``.
    """
    if settings.clip_ratio_c <= 1.0:
        raise ValueError(
            f"actor.clip_ratio_c={settings.clip_ratio_c}: the dual-clip bound must be > 1.0 (DAPO uses 10)"
        )
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    clip_max, clipped = _pessimistic(ratio, advantages, settings.clip_ratio_low, settings.clip_ratio_high)
    dual_bound = -advantages * settings.clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(dual_bound, clip_max), clip_max)
    metrics = {
        "pg_clipfrac": masked_mean(clipped.float(), mask).item(),
        "pg_clipfrac_lower": masked_mean(((clip_max > dual_bound) & negative).float(), mask).item(),
        "ppo_kl": masked_mean(-log_ratio, mask).item(),
    }
    return settings.aggregate(loss_mat, mask), metrics


def gspo(token_level: bool) -> LossFn:
    """GSPO (arXiv 2507.18071): one ratio per sequence, ``s_i = exp(mean_t (lp - old_lp))``,
    clipped like PPO, averaged over sequences. ``token_level=False`` (``gspo``): with the row's
    mean advantage. ``token_level=True`` (``gspo_token``): ``s_i,t = sg[s_i] * pi_t / sg[pi_t]``
    with per-token advantages, the value of ``s_i`` and a per-token gradient (with one advantage
    per row, value and gradient equal ``gspo``'s). The paper's clip range is far narrower than a
    token ratio's (eps 3e-4 / 4e-4): set ``actor.clip_ratio_low/high``. ``clip_ratio_c`` (dual
    clip) does not apply."""

    def loss(old_log_prob, log_prob, advantages, mask, settings: PolicyLossSettings):
        log_ratio = _log_ratio(old_log_prob, log_prob)
        sequence_log_ratio = _row_mean(log_ratio, mask)[:, None]  # log s_i = mean_t log r_t
        if token_level:
            ratio = torch.exp(sequence_log_ratio.detach() + log_prob - log_prob.detach())
            row_advantages = advantages
        else:
            ratio = torch.exp(sequence_log_ratio).expand_as(log_prob)
            row_advantages = _row_mean(advantages, mask)[:, None].expand_as(log_prob)
        loss_mat, clipped = _pessimistic(ratio, row_advantages, settings.clip_ratio_low, settings.clip_ratio_high)
        metrics = {
            "pg_clipfrac": masked_mean(clipped.float(), mask).item(),
            "ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
        return settings.aggregate(loss_mat, mask), metrics

    return loss


register_policy_loss("gspo", loss_agg_modes=SEQUENCE_LEVEL)(gspo(token_level=False))
register_policy_loss("gspo_token", loss_agg_modes=SEQUENCE_LEVEL)(gspo(token_level=True))


@register_policy_loss("cispo")
def cispo_loss(old_log_prob, log_prob, advantages, mask, settings: PolicyLossSettings):
    """CISPO (MiniMax-M1, arXiv 2506.13585): ``-sg[clip(r, 1-eps_low, 1+eps_high)] * A * lp``.

    The IS weight is clipped and detached instead of the update being cut off, so every token
    keeps a gradient (PPO zeroes it on clipped tokens). The paper clips only from above (a large
    ``clip_ratio_low``, e.g. 1.0, disables the lower bound). ``pg_clipfrac``: tokens whose weight
    was clipped.
    """
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high).detach()
    loss_mat = -weight * advantages * log_prob
    metrics = {
        "pg_clipfrac": masked_mean((weight != ratio.detach()).float(), mask).item(),
        "ppo_kl": masked_mean(-log_ratio, mask).item(),
    }
    return settings.aggregate(loss_mat, mask), metrics


@register_policy_loss("gmpo", loss_agg_modes=SEQUENCE_LEVEL)
def gmpo_loss(old_log_prob, log_prob, advantages, mask, settings: PolicyLossSettings):
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios instead of their mean.

    Per token, in log space, the pessimistic choice between ``log r`` and its clip to
    ``[log(1-eps_low), log(1+eps_high)]`` (the larger for ``A < 0``, the smaller for ``A > 0``);
    the row loss is ``-A * exp(mean_t of those)``, averaged over sequences. The paper clips to
    ``(e^-0.4, e^0.4)``: ``clip_ratio_low=0.33``, ``clip_ratio_high=0.49``. ``pg_clipfrac``:
    tokens where the clip won.
    """
    low, high = settings.clip_ratio_low, settings.clip_ratio_high
    log_ratio = _log_ratio(old_log_prob, log_prob)
    bounded = torch.clamp(log_ratio, math.log(1.0 - low) if low < 1 else -LOG_RATIO_CLAMP, math.log1p(high))
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    row_advantages = _row_mean(advantages, mask)
    row_loss = -row_advantages * torch.exp(_row_mean(pessimistic, mask))
    loss_mat = row_loss[:, None].expand_as(log_prob)
    clipped = (pessimistic != log_ratio) & (sign != 0)
    metrics = {
        "pg_clipfrac": masked_mean(clipped.float(), mask).item(),
        "ppo_kl": masked_mean(-log_ratio, mask).item(),
    }
    return settings.aggregate(loss_mat, mask), metrics


def reinforce_loss(old_log_prob, log_prob, advantages, mask, settings: PolicyLossSettings):
    """REINFORCE, ``-A * lp * w`` (w: the IS weights, or 1), for bypass mode
    (``algorithm.rollout_correction.loss_type=reinforce``; not a registered policy loss): there
    the old log-probs are the rollout's, so no ratio is clipped and the correction comes only
    from the truncated, detached IS weights. ``old_log_prob`` is not read."""
    return settings.aggregate(-advantages * log_prob, mask), {}
