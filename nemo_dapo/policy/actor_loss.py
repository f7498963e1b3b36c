"""The DAPO actor loss of one micro-batch, shared by every training backend.

Backends differ in how they produce per-token log-probs and entropy; what they do with them
(the policy loss named by ``actor.policy_loss``, aggregated with mini-batch-wide counts,
entropy bonus, KL loss, bypass-mode correction) is here, once, built from ``nemo_dapo.algo``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.correction import CorrectionSettings, apply_rollout_correction
from nemo_dapo.algo.kl import kl_penalty
from nemo_dapo.algo.loss import masked_mean
from nemo_dapo.algo.policy_losses import PolicyLossSettings, get_policy_loss, reinforce_loss
from nemo_dapo.policy.base import LossSettings, MiniBatch
from nemo_dapo.policy.microbatch import MicroBatch, RowStats


def micro_batch_loss(
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    micro: MicroBatch,
    mini: MiniBatch,
    settings: LossSettings,
    correction: CorrectionSettings | None,
    forward: RowStats | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`actor_loss` of one micro-batch of ``mini``, with its old log-probs: the rollout's in
    bypass mode; with ``forward`` (``mini.old_from_forward``), this forward's own, detached and
    recorded in ``forward`` for the trainer; else the batch's ``old_log_probs``."""
    if forward is not None:
        forward.add(micro.rows, log_probs, entropy)
        old_log_probs = log_probs.detach()
    else:
        old_log_probs = micro["rollout_log_probs" if settings.bypass_mode else "old_log_probs"]
    return actor_loss(
        log_probs, entropy, old_log_probs, micro, settings, mini.global_token_count, mini.global_seq_count, correction
    )


def actor_loss(
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    old_log_probs: torch.Tensor,
    micro: MicroBatch,
    settings: LossSettings,
    global_token_count: float,
    global_seq_count: float,
    correction: CorrectionSettings | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss whose gradients, summed over micro-batches and ranks, equal the mini-batch gradient.
    ``old_log_probs``: the old policy's (in bypass mode the rollout's, which the correction's
    weights compare with the current policy)."""
    mask = micro["loss_mask"].float()
    weights = micro.get("is_weights")
    metrics: dict[str, float] = {}
    if settings.bypass_mode and correction is not None:  # weights against the current policy, inside the loss
        weights, mask, metrics = apply_rollout_correction(log_probs.detach(), old_log_probs, mask, correction)
    pg = PolicyLossSettings(
        clip_ratio_low=settings.clip_ratio_low,
        clip_ratio_high=settings.clip_ratio_high,
        clip_ratio_c=settings.clip_ratio_c,
        loss_agg_mode=settings.loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        norm_constant=settings.norm_constant,
        is_weights=weights,
    )
    loss_fn = reinforce_loss if settings.loss_type == "reinforce" else get_policy_loss(settings.policy_loss).fn
    pg_loss, pg_metrics = loss_fn(old_log_probs, log_probs, micro["advantages"], mask, pg)
    loss = pg_loss
    unweighted = replace(pg, is_weights=None)
    entropy_value = unweighted.aggregate(entropy, mask)
    if settings.entropy_coeff:
        loss = loss - settings.entropy_coeff * entropy_value
    if settings.use_kl_loss:
        kl = unweighted.aggregate(kl_penalty(log_probs, micro["ref_log_probs"], settings.kl_loss_type), mask)
        loss = loss + settings.kl_loss_coef * kl
        metrics[mn.KL_LOSS.name] = kl.item()
    # a policy loss names its metrics briefly (pg_clipfrac): they are logged under actor/
    metrics.update({f"actor/{k}": v for k, v in pg_metrics.items()})
    # pg_loss and entropy are this micro-batch's share of the mini-batch value (Reduce.SUM)
    metrics[mn.PG_LOSS.name] = pg_loss.item()
    metrics[mn.ENTROPY.name] = entropy_value.item()
    metrics[mn.ENTROPY_TOKEN_MEAN.name] = masked_mean(entropy.detach(), mask).item()
    return loss, metrics
