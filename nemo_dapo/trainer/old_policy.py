"""The old policy's log-probs and entropy of a batch (docs/algorithm.md §8), from one place.

The old_log_prob stage scores the rows with the policy's own pass. Where exact
(``actor.old_log_prob_from_forward``, see :func:`rows_scored_by_update`), the rows of the first
mini-batch are left to the update: its first forward runs on the same weights, so the log-probs
it computes are the old ones, and a pass over those rows is saved. :class:`OldPolicyScores`
knows which rows each source scores; the old policy's metrics and rollout correction come once
every row is scored: before the update when the pass scored them all (decoupled correction's
weights must reach the loss), after it otherwise: the two calls :meth:`OldPolicyScores.before_update`
and :meth:`OldPolicyScores.after_update`. In bypass mode the rollout log-probs are the old
policy: nothing is scored.
"""

from __future__ import annotations

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.correction import CorrectionSettings, mismatch_metrics
from nemo_dapo.config.schema import Config
from nemo_dapo.policy.inputs import mini_batch_rows
from nemo_dapo.policy.microbatch import ROUTED_EXPERTS
from nemo_dapo.policy.routing import split_routing
from nemo_dapo.trainer.stages import add_rollout_correction
from nemo_dapo.trainer.tracking import StageTimer

# The batch fields of the old policy's scores, and the keys a log-prob pass returns them under.
OLD_POLICY_FIELDS = {"old_log_probs": "log_probs", "old_entropy": "entropy"}


class OldPolicyScores:
    """Which rows of ``batch`` the old_log_prob pass scores (:attr:`by_pass`) and which the
    update's first forward scores (:attr:`by_update`, None when it scores none)."""

    def __init__(self, batch: RolloutBatch, cfg: Config, correction: CorrectionSettings) -> None:
        self.cfg, self.correction = cfg, correction
        self.bypass = correction.bypass_mode
        self.by_update = None if self.bypass else rows_scored_by_update(batch, cfg, correction)
        rows = set(range(len(batch))) - set([] if self.by_update is None else self.by_update.tolist())
        self.by_pass = torch.tensor([] if self.bypass else sorted(rows), dtype=torch.long)

    @property
    def first_mini_batch_by_update(self) -> bool:
        return self.by_update is not None

    def before_update(self, policy, batch: RolloutBatch, timer: StageTimer) -> dict[str, float]:
        """The old_log_prob pass over :attr:`by_pass` (the rows left to the update stay zero); when
        it scored every row, the old policy's metrics and rollout correction too, whose weights the
        loss needs. Nothing in bypass mode. Runs after the filters narrowed ``loss_mask``."""
        if self.bypass:
            return {}
        every_row = self.by_update is None
        part = batch if every_row else batch.select(self.by_pass)
        with timer("old_log_prob"):
            scored = policy.compute_log_prob(part, self.cfg.rollout.temperature) if len(self.by_pass) else {}
        for name, key in OLD_POLICY_FIELDS.items():
            values = scored[key] if every_row else torch.zeros(batch["responses"].shape)
            if not every_row and len(self.by_pass):
                values[self.by_pass] = scored[key]
            batch.add(name, values)
        if not every_row:
            return {}
        return {**add_old_log_prob_extras(batch, scored), **self._metrics_and_correction(batch)}

    def after_update(self, batch: RolloutBatch, first_forward: dict[str, torch.Tensor] | None) -> dict[str, float]:
        """The update's first forward completes the rows it scored; then the old policy's metrics
        (no correction weights are due: :func:`rows_scored_by_update` leaves none configured)."""
        if self.by_update is None:
            return {}
        if first_forward is None:
            raise RuntimeError("the policy's update returned no first_forward for rows it was to score")
        for name, key in OLD_POLICY_FIELDS.items():
            values = batch[name].clone()
            values[self.by_update] = first_forward[key][:, : values.shape[1]]
            batch.add(name, values, overwrite=True)  # completes the field the old_log_prob pass began
        return self._metrics_and_correction(batch)

    def _metrics_and_correction(self, batch: RolloutBatch) -> dict[str, float]:
        """The old policy's entropy and its gap to the engines (``rollout_corr/*``), with decoupled
        correction's weights and rejection added to the batch."""
        mask = batch["response_mask"]
        entropy = float((batch["old_entropy"] * mask).sum() / mask.sum().clamp(min=1))
        return {mn.ENTROPY_OLD.name: entropy, **add_rollout_correction(batch, self.correction)}


def add_old_log_prob_extras(batch: RolloutBatch, out: dict[str, torch.Tensor]) -> dict[str, float]:
    """MoE routing replay's part of the old_log_prob pass (docs/moe.md): r2's recorded routing
    joins the batch for the update to replay; r3's log-probs under the trainer's own routing
    measure the mismatch replay removed (``rollout_corr/no_replay/*``)."""
    if ROUTED_EXPERTS in out:
        for name, half in split_routing(out[ROUTED_EXPERTS], batch["prompts"].shape[1]).items():
            batch.add(name, half)
    if "own_log_probs" not in out:
        return {}
    own = mismatch_metrics(out["own_log_probs"], batch["rollout_log_probs"], batch["loss_mask"].float())
    return {mn.NO_REPLAY_PREFIX + name.removeprefix("rollout_corr/"): value for name, value in own.items()}


def rows_scored_by_update(batch: RolloutBatch, cfg: Config, correction: CorrectionSettings) -> torch.Tensor | None:
    """The rows whose old log-probs the update's first forward gives (``actor.old_log_prob_from_forward``),
    or None where that would not be exact.

    The first optimizer step of a batch runs its forward on the weights the old_log_prob pass
    would use, so the log-probs it computes are the old ones. Nothing may read them earlier: a
    second epoch, the KL in the reward, IS weights and rejection sampling (applied before the
    loss), MoE routing replay (r2 records its routing in that pass) all keep the separate pass.
    """
    exact = (
        cfg.actor.old_log_prob_from_forward
        and cfg.actor.ppo_epochs == 1
        and not correction.bypass_mode
        and not cfg.algorithm.use_kl_in_reward
        and not (correction.rollout_is or correction.rollout_rs)
        and cfg.actor.megatron.router_replay == "none"
    )
    return mini_batch_rows(batch, cfg.actor.ppo_mini_batch_size)[0] if exact else None
