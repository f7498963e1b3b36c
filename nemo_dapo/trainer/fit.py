"""The DAPO trainer of every mode (docs/algorithm.md §8): a batch from the mode's source ->
old_log_prob -> ref -> advantages -> update_actor -> weight sync, with validation, checkpoints
and the stop clock around the steps.

The trainer talks to a policy group, a rollout group and a batch source through their
interfaces only; it does not know whether they are Ray actors on a laptop or GPU processes on a
cluster, nor whether the batch was generated for the step or streamed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import RolloutBatch, group_rows
from nemo_dapo.algo.metrics import throughput_metrics, timing_metrics
from nemo_dapo.cluster.weight_sync import weight_sync
from nemo_dapo.config import Config, to_yaml
from nemo_dapo.config.topology import cluster_gpus, prompts_per_round, total_training_steps
from nemo_dapo.data import ResumableBatchSampler
from nemo_dapo.errors import GenerationStopped
from nemo_dapo.folders import open_run_file
from nemo_dapo.policy.weights import WEIGHT_BUCKET_BYTES
from nemo_dapo.rng import restore_rng, rng_state
from nemo_dapo.safe_load import load_state
from nemo_dapo.trainer.checkpoint import TRAINER_STATE, CheckpointManager, refuse_mode_change
from nemo_dapo.trainer.health import LearningHealth, NonFiniteSteps
from nemo_dapo.trainer.preemption import Preempted, PreemptionSignals, StepAbandoned, StepClock, record_preemption
from nemo_dapo.trainer.source import BatchSource, PromptDraws, StepPlace
from nemo_dapo.trainer.summary import write_summary
from nemo_dapo.trainer.sync_source import SyncSource
from nemo_dapo.trainer.tracking import StageTimer, Tracker
from nemo_dapo.trainer.update import PolicyUpdate
from nemo_dapo.trainer.validation import mean_val_accuracy, validation_metrics

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
    from nemo_dapo.data.dataset import RLDataset
    from nemo_dapo.reward.manager import RewardManager

log = logging.getLogger(__name__)


def batch_source(
    cfg: Config,
    policy: PolicyGroup,
    rollout: RolloutGroup,
    tokenizer: PreTrainedTokenizerBase,
    data: RLDataset,
    reward: RewardManager,
) -> BatchSource:
    """``trainer.mode``'s batch source over the training data."""
    draws = PromptDraws(
        ResumableBatchSampler(len(data), prompts_per_round(cfg), seed=cfg.data.seed, shuffle=cfg.data.shuffle),
        data.row_id,
    )
    if cfg.trainer.mode == "stream":
        from nemo_dapo.trainer.stream_source import StreamSource, stream_engines

        return StreamSource(cfg, draws, data, stream_engines(cfg, rollout), tokenizer, reward)
    return SyncSource(cfg, draws, data, policy, rollout, tokenizer, reward)


class DAPOTrainer:
    """The DAPO run (docs/algorithm.md §8) over a policy, a rollout and optionally a reference
    group, on the driver: :meth:`fit` runs steps until the budget is spent, with validation,
    checkpoints, preemption and the learning-health warnings around them. Each step's batch
    comes from the mode's :class:`~nemo_dapo.trainer.source.BatchSource`, which also says what
    happens around the update and the sync and keeps its part of the checkpointed state.
    """

    def __init__(
        self,
        cfg: Config,
        policy: PolicyGroup,
        rollout: RolloutGroup,
        tokenizer: PreTrainedTokenizerBase,
        train_data: RLDataset,
        val_data: RLDataset | None,
        reward: RewardManager,
        ref_policy: PolicyGroup | None = None,
        source: BatchSource | None = None,
    ) -> None:
        self.cfg, self.policy, self.rollout, self.ref_policy = cfg, policy, rollout, ref_policy
        self.tokenizer, self.train_data, self.val_data, self.reward = tokenizer, train_data, val_data, reward
        self.output_dir = Path(cfg.trainer.output_dir)
        self.tracker = Tracker.for_run(cfg)
        self.checkpoints = CheckpointManager(
            self.output_dir / "checkpoints", cfg.checkpoint.keep_last, hasher=policy.digest_files
        )
        self.pending_checkpoint: Path | None = None  # staged, its sharded state still being written
        self.saved_step: int | None = None  # the step of the newest checkpoint written or resumed
        self.steps_this_run = 0  # steps this process finished (a stop without any made no progress)
        self.started = time.time()  # from when stop signals were caught
        self.stop_asked: Callable[[], bool] = lambda: False  # a stop signal arrived (set by fit)
        self.source = source or batch_source(cfg, policy, rollout, tokenizer, train_data, reward)
        self.update = PolicyUpdate(cfg, policy, ref_policy)
        self.global_step = 0
        self.weight_version = 0
        self.health = LearningHealth()
        self.nonfinite = NonFiniteSteps(cfg.trainer.max_nonfinite_steps)
        self.initial_val: dict[str, float] = {}
        # the latest validation not given up, and the step whose weights it measured: a run resumed
        # at its last step takes its final accuracy from there (kept in the checkpoint)
        self.last_val: dict[str, float] = {}
        self.last_val_step: int | None = None
        self.total_steps = total_training_steps(cfg, len(train_data))
        self.rollout.set_weight_source(self._current_weights)  # for an engine replaced mid-run
        self.weight_sync = weight_sync(cfg.rollout.weight_transfer, policy, rollout, WEIGHT_BUCKET_BYTES)

    @property
    def generated_samples(self) -> int:
        """Samples generated so far: the axis of ``trainer.total_generated_samples``."""
        return self.source.draws.generated_samples

    # ----------------------------------------------------------------- one step
    def train_step(self) -> dict[str, float]:
        """One step in every mode (docs/algorithm.md §8): the source's next batch, trained by
        :class:`~nemo_dapo.trainer.update.PolicyUpdate`, the new weights into the engines, the step's metrics and its
        prompts recorded; the source says what happens around the update and the sync."""
        timer = StageTimer()
        step_start = time.perf_counter()
        place = StepPlace(self.global_step, self.weight_version, self.stop_asked)
        batch, metrics = self.source.next_batch(place, timer)
        metrics.update(self.source.before_update(batch, self.weight_version))
        metrics.update(self.update(batch, timer))
        self.source.sync(timer, self.sync_weights)
        self.source.after_sync()
        self._finish_step_metrics(batch, metrics, timer, step_start)
        metrics.update(self.source.metrics(timer, time.perf_counter() - step_start))
        consumed, extra = self.source.prompts_of_step()
        self._record_prompts(consumed, batch, extra)
        return metrics

    def _finish_step_metrics(self, batch: RolloutBatch, metrics: dict, timer: StageTimer, step_start: float) -> None:
        response_tokens = int(batch["response_mask"].sum())
        total_tokens = response_tokens + int(batch["prompt_mask"].sum())
        metrics.update(timing_metrics(timer.seconds, response_tokens, total_tokens))
        devices = max(cluster_gpus(self.cfg), self.policy.world_size)
        metrics.update(throughput_metrics(total_tokens, time.perf_counter() - step_start, devices))
        metrics[mn.ENGINE_RESTARTS.name] = float(self.rollout.restarts)
        metrics[mn.ENGINES_IN_SERVICE.name] = float(len(self.rollout.in_service()))
        metrics[mn.GENERATED_SAMPLES.name] = float(self.generated_samples)  # cumulative: the budget's axis
        if self.weight_sync.sent_bytes is not None:
            metrics[mn.WEIGHT_SYNC_MB.name] = self.weight_sync.sent_bytes / 2**20

    def sync_weights(self) -> None:
        """The new weights into the engines in service, lost engines whose node is back included."""
        self.weight_version += 1
        self.rollout.restore_lost()
        self.weight_sync(self.weight_version)

    def _current_weights(self) -> tuple[Iterator, int]:
        """The policy's weights as streamed buckets, with their version."""
        return self.policy.export_weights(WEIGHT_BUCKET_BYTES), self.weight_version

    def _record_prompts(self, consumed: list[int], batch: RolloutBatch, extra: dict | None = None) -> None:
        """Which dataset rows each step drew and trained on (audit trail for resume): ``trained``
        names each trained group's row, so a row drawn in two epochs whose groups meet in one
        batch (the stream's groups finish out of order) is named twice."""
        groups = group_rows(batch["uid"]).values()
        trained = sorted(int(batch["prompt_index"][rows[0]]) for rows in groups)
        with open_run_file(self.output_dir / "prompts.jsonl") as handle:
            record = {"step": self.global_step + 1, "consumed": consumed, "trained": trained}
            record |= extra or {}
            handle.write(json.dumps(record) + "\n")

    # ----------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """The validation metrics; none when a stop came while the held-out set generated (the
        stopping run saves without them rather than wait for a long validation's end)."""
        if self.val_data is None:
            return {}
        try:
            return validation_metrics(
                self.rollout, self.val_data, self.cfg, self.tokenizer, self.reward, self.weight_version, self.stop_asked
            )
        except GenerationStopped:
            log.warning("a stop came while validating after step %d: validation given up", self.global_step)
            return {}

    # ----------------------------------------------------------------- checkpoints
    def trainer_state(self) -> dict:
        return {
            "global_step": self.global_step,
            "mode": self.cfg.trainer.mode,
            "weight_version": self.weight_version,
            **self.source.state(),
            "kl_coef": self.update.kl_controller.value,
            "initial_val": self.initial_val,
            "last_val": self.last_val,
            "last_val_step": self.last_val_step,
            "rng": rng_state(),
        }

    def save_checkpoint(self) -> None:
        """Checkpoint this step; with ``checkpoint.async_save`` the policy's sharded state is written
        in the background and the checkpoint is committed by a later :meth:`finish_checkpoint`."""
        self.finish_checkpoint()  # one background write at a time, committed in step order
        asynchronous = self.cfg.checkpoint.async_save

        def write(folder: Path) -> None:
            self.policy.save(str(folder / "policy"), asynchronous=asynchronous)
            torch.save(self.trainer_state(), folder / TRAINER_STATE)
            (folder / "config.yaml").write_text(to_yaml(self.cfg))

        self.pending_checkpoint = self.checkpoints.stage(self.global_step, write)
        self.saved_step = self.global_step
        self.finish_checkpoint(blocking=not asynchronous)

    def finish_checkpoint(self, blocking: bool = True) -> None:
        """Commit the staged checkpoint once every rank has written its part (waiting for that
        when ``blocking``); until then the previous checkpoint stays the latest."""
        if self.pending_checkpoint is None or not self.policy.finish_save(blocking):
            return
        path = self.checkpoints.commit(self.pending_checkpoint)
        self.pending_checkpoint = None
        log.info("saved checkpoint %s", path)

    def load_checkpoint(self, path: Path) -> None:
        state = load_state(path / TRAINER_STATE)
        refuse_mode_change(state, self.cfg.trainer.mode, path)
        self.policy.load(str(path / "policy"))
        self.global_step = self.saved_step = state["global_step"]
        self.update.kl_controller.value = state["kl_coef"]
        self.initial_val = state["initial_val"]
        self.last_val = state.get("last_val", self.initial_val)  # checkpoints from before it was kept
        self.last_val_step = state.get("last_val_step")
        restore_rng(state["rng"])
        self.weight_version = state["weight_version"]
        self.source.restore(state, self.global_step)
        self.sync_weights()  # the engines started from the base model: give them the checkpoint's weights
        log.info("resumed from %s at step %d", path, self.global_step)

    # ----------------------------------------------------------------- the loop
    def fit(self, preemption: PreemptionSignals | None = None) -> dict:
        """Train to the end, or stop (:class:`Preempted`) when ``preemption`` (here: the stop
        signals caught from now on) asks; ``nemo-dapo train`` catches them from its start."""
        with contextlib.ExitStack() as stack:
            if preemption is None:
                preemption = stack.enter_context(PreemptionSignals())
            stack.enter_context(logging_redirect_tqdm())  # log lines go above the progress bar
            self.stop_asked = lambda: preemption.requested
            self.started = preemption.since
            return self._fit(preemption)

    def _begin(self, preemption: PreemptionSignals) -> None:
        """Resume from the checkpoint, or validate the base model first; a stop that came while the
        workers started (or during that validation) leaves before any step, with nothing to save."""
        if preemption.requested:
            self._stop_preempted(preemption.received or "a stop signal", bar=None)
        resume_from = self.checkpoints.resolve_resume(self.cfg.checkpoint.resume)
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        elif self.cfg.trainer.val_before_train:
            self.initial_val = self._validate_now()
            self.tracker.log(self.initial_val, self.global_step)
            if preemption.requested:
                self._stop_preempted(preemption.received or "a stop signal", bar=None)

    def _fit(self, preemption: PreemptionSignals) -> dict:
        start = time.time()
        self._begin(preemption)
        bar = tqdm(total=self.total_steps, initial=self.global_step, desc="DAPO", dynamic_ncols=True)
        clock = StepClock(self.cfg.checkpoint.save_by)
        while not self._run_done():
            next_step = self.global_step + 1
            if clock.no_room(time.time(), self._validates(next_step, next_step >= self.total_steps)):
                self._stop_preempted("checkpoint.save_by (the job's end is near)", bar)
            self.finish_checkpoint(blocking=False)
            began = time.monotonic()
            try:
                metrics = self.train_step()
            except StepAbandoned as why:  # the signal came while it generated: the last step is what is saved
                log.warning(
                    "%s while generating step %d (%s): the step is given up", preemption.received, next_step, why
                )
                self._stop_preempted(preemption.received or "a stop signal", bar)
            clock.steps.append(time.monotonic() - began)
            self.global_step += 1
            self.steps_this_run += 1
            done = self._run_done()
            if self._validates(self.global_step, done) and not preemption.requested:  # none on the way out
                began = time.monotonic()
                metrics.update(self._validate_now())
                clock.validation_s = time.monotonic() - began
            self.tracker.log(metrics, self.global_step)
            skipped = self.nonfinite.observe(self.global_step, metrics.get(mn.SKIPPED_STEPS.name, 0.0))
            for warning in [*self.health.observe(self.global_step, metrics), skipped]:
                if warning:
                    log.warning(warning)
            if self._due(self.cfg.trainer.save_freq, self.global_step) or done:
                began = time.monotonic()
                self.save_checkpoint()
                clock.save_s = time.monotonic() - began
            bar.update(1)
            bar.set_postfix(
                score=f"{metrics.get('critic/score/mean', 0):.3f}",
                acc=f"{metrics.get('critic/acc/mean', 0):.3f}",
                val=f"{mean_val_accuracy(self.last_val) or 0:.3f}",
            )
            # asked now, or during the validation or the save; at the last step too while unvalidated
            if preemption.requested and not (done and self._final_val_known()):
                self._stop_preempted(preemption.received or "a stop signal", bar)
        bar.close()
        self.finish_checkpoint()
        if not self._final_val_known():  # resumed at the last step of a run stopped before validating it
            self._final_validation(preemption)
        self.tracker.close()
        took = time.time() - start
        return write_summary(
            self.output_dir,
            self.initial_val,
            self.last_val,
            self.global_step,
            self.generated_samples,
            took,
        )

    def _validate_now(self) -> dict[str, float]:
        """:meth:`validate`, kept as the latest validation of this step's weights unless a stop
        gave it up (then it is none: a resumed run validates these weights again)."""
        metrics = self.validate()
        if not self.stop_asked():
            self.last_val, self.last_val_step = metrics, self.global_step
        return metrics

    def _final_val_known(self) -> bool:
        """Whether the last trained weights have their validation (none is due without a held-out
        set): a stop at the last step before it leaves it to the resumed run, not to summary.json."""
        return self.val_data is None or self.last_val_step == self.global_step

    def _final_validation(self, preemption: PreemptionSignals) -> None:
        """The final validation of a run resumed at its last step, which the stop that ended the
        earlier run came before (its checkpoint holds no validation of these weights)."""
        log.info("step %d was checkpointed before its final validation: validating it now", self.global_step)
        metrics = self._validate_now()
        if preemption.requested:
            self._stop_preempted(preemption.received or "a stop signal", bar=None)
        self.tracker.log(metrics, self.global_step)

    def _stop_preempted(self, signal_name: str, bar: tqdm | None) -> None:
        """Checkpoint (unless this step has one, or none was trained) and leave: the requeued job
        resumes from here."""
        if self.global_step > 0 and self.saved_step != self.global_step:
            self.save_checkpoint()
        self.finish_checkpoint()
        if self._run_done() and not self._final_val_known():
            log.warning("step %d, the last, is saved unvalidated: the resumed run validates it first", self.global_step)
        if bar is not None:
            bar.close()
        self.tracker.close()
        stop = Preempted(self.global_step, signal_name, self.steps_this_run > 0, time.time() - self.started)
        record_preemption(self.output_dir, stop)
        raise stop

    @staticmethod
    def _due(freq: int, step: int) -> bool:
        """Whether ``step`` is one of every ``freq`` steps (``freq`` <= 0: none)."""
        return freq > 0 and step % freq == 0

    def _validates(self, step: int, last: bool) -> bool:
        """Whether step ``step`` ends with validation: every ``trainer.test_freq`` steps, and the last."""
        return self._due(self.cfg.trainer.test_freq, step) or (last and self.val_data is not None)

    def _run_done(self) -> bool:
        """Every step taken, or the sample budget (``trainer.total_generated_samples``) spent."""
        budget = self.cfg.trainer.total_generated_samples
        return self.global_step >= self.total_steps or (budget is not None and self.generated_samples >= budget)
