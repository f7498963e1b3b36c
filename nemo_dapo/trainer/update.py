"""A batch's way into the policy, the same in every mode (docs/algorithm.md §8): the overlong
filter -> old_log_prob -> ref -> rewards and advantages -> update_actor, and the batch's metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.correction import correction_settings
from nemo_dapo.algo.kl import build_kl_controller
from nemo_dapo.config import Config
from nemo_dapo.trainer.old_policy import OldPolicyScores
from nemo_dapo.trainer.settings import loss_settings
from nemo_dapo.trainer.stages import add_advantages, add_overlong_filter, add_rewards, batch_metrics
from nemo_dapo.trainer.tracking import StageTimer

if TYPE_CHECKING:
    from nemo_dapo.cluster.groups import PolicyGroup


class PolicyUpdate:
    """Trains the policy on one batch; keeps the KL controller (whose coefficient a checkpoint keeps)."""

    def __init__(self, cfg: Config, policy: PolicyGroup, ref_policy: PolicyGroup | None = None) -> None:
        self.cfg, self.policy, self.ref_policy = cfg, policy, ref_policy
        self.correction = correction_settings(cfg.algorithm.rollout_correction)
        self.loss_settings = loss_settings(cfg, self.correction)
        kl = cfg.algorithm.kl_ctrl
        self.kl_controller = build_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)

    def __call__(self, batch: RolloutBatch, timer: StageTimer) -> dict[str, float]:
        """The step's metrics. Which rows the old policy's own pass scores, and which the update's
        first forward does, is :class:`~nemo_dapo.trainer.old_policy.OldPolicyScores`'s to say."""
        metrics = add_overlong_filter(batch, self.cfg)  # finish reasons alone: before any pass
        old = OldPolicyScores(batch, self.cfg, self.correction)
        metrics.update(old.before_update(self.policy, batch, timer))
        if self.ref_policy is not None:
            with timer("ref"):
                ref = self.ref_policy.compute_log_prob(batch, self.cfg.rollout.temperature)
            batch.add("ref_log_probs", ref["log_probs"])
        with timer("adv"):
            metrics.update(add_rewards(batch, self.cfg, self.kl_controller))
            add_advantages(batch, self.cfg)
        with timer("update_actor"):
            result = self.policy.update(
                batch,
                self.loss_settings,
                self.cfg.actor.ppo_mini_batch_size,
                self.cfg.actor.ppo_epochs,
                self.correction if self.correction.bypass_mode else None,
                first_old_from_forward=old.first_mini_batch_by_update,
            )
        metrics.update(result.metrics)
        metrics.update(old.after_update(batch, result.first_forward))
        metrics.update(batch_metrics(batch, self.cfg))
        return metrics
