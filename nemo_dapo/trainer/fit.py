"""The synchronous DAPO trainer (docs/algorithm.md §8): generate -> reward -> filter -> old_log_prob -> ref
-> advantages -> update_actor -> weight sync, with validation and checkpoints.

The trainer talks to a policy group and a rollout group through their interfaces only; it
does not know whether they are Ray actors on a laptop or GPU processes on a cluster.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.correction import correction_settings
from nemo_dapo.algo.kl import build_kl_controller
from nemo_dapo.algo.metrics import throughput_metrics, timing_metrics
from nemo_dapo.algo.sampling import GroupAccumulator
from nemo_dapo.cluster.weight_sync import weight_sync
from nemo_dapo.config import Config, to_yaml
from nemo_dapo.config.topology import cluster_gpus, is_colocated, prompts_per_round, total_training_steps
from nemo_dapo.data import ResumableBatchSampler
from nemo_dapo.errors import GenerationStopped
from nemo_dapo.folders import open_run_file
from nemo_dapo.rng import restore_rng, rng_state
from nemo_dapo.safe_load import load_state
from nemo_dapo.trainer.assembly import loss_settings
from nemo_dapo.trainer.batching import batch_from_items
from nemo_dapo.trainer.checkpoint import TRAINER_STATE, CheckpointManager, refuse_mode_change
from nemo_dapo.trainer.health import LearningHealth, NonFiniteSteps
from nemo_dapo.trainer.old_policy import OldPolicyScores
from nemo_dapo.trainer.preemption import Preempted, PreemptionSignals, StepAbandoned, StepClock, record_preemption
from nemo_dapo.trainer.sinks import SinkContext
from nemo_dapo.trainer.stages import (
    add_advantages,
    add_overlong_filter,
    add_rewards,
    batch_metrics,
    score_batch,
)
from nemo_dapo.trainer.summary import write_summary
from nemo_dapo.trainer.tracking import StageTimer, Tracker
from nemo_dapo.trainer.validation import mean_val_accuracy, train_sampling, validation_metrics

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
    from nemo_dapo.data.dataset import RLDataset
    from nemo_dapo.reward.manager import RewardManager

log = logging.getLogger(__name__)
WEIGHT_BUCKET_BYTES = 512 << 20


class DAPOTrainer:
    """The synchronous DAPO loop (docs/algorithm.md §8) over a policy, a rollout and optionally a
    reference group, on the driver: :meth:`fit` runs steps until the budget is spent, with
    validation, checkpoints, preemption and the learning-health warnings around them.

    What a mode replaces (the streaming trainer does): the hooks of :meth:`train_step` (where
    its batch comes from, what happens around the update and the sync, its own metrics and
    prompt record), and :meth:`trainer_state` / :meth:`_restore`, its part of the state a
    checkpoint keeps beyond the workers'. What every mode shares: :meth:`train_step` itself,
    :meth:`train_on_batch` (old policy, reference, advantages, update), :meth:`sync_weights`,
    :meth:`validate`, checkpoint writing and :meth:`fit`.
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
    ) -> None:
        self.cfg, self.policy, self.rollout, self.ref_policy = cfg, policy, rollout, ref_policy
        self.tokenizer, self.train_data, self.val_data, self.reward = tokenizer, train_data, val_data, reward
        self.output_dir = Path(cfg.trainer.output_dir)
        self.tracker = Tracker(
            cfg.trainer.loggers,
            SinkContext(
                self.output_dir,
                cfg.trainer.project_name,
                cfg.trainer.experiment_name,
                asdict(cfg),
                cfg.trainer.wandb_mode,
                cfg.trainer.mlflow_tracking_uri,
            ),
        )
        self.checkpoints = CheckpointManager(
            self.output_dir / "checkpoints", cfg.checkpoint.keep_last, hasher=policy.digest_files
        )
        self.pending_checkpoint: Path | None = None  # staged, its sharded state still being written
        self.saved_step: int | None = None  # the step of the newest checkpoint written or resumed
        self.steps_this_run = 0  # steps this process finished (a stop without any made no progress)
        self.started = time.time()  # from when stop signals were caught
        filtering = cfg.algorithm.filter_groups
        self.sampler = ResumableBatchSampler(
            len(train_data), prompts_per_round(cfg), seed=cfg.data.seed, shuffle=cfg.data.shuffle
        )
        self._sampler_iter: Iterator[list[int]] | None = None
        self._consumed: list[int] = []  # row ids drawn from the sampler this step (prompts.jsonl)
        self.stop_asked: Callable[[], bool] = lambda: False  # a stop signal arrived (set by fit)
        self.accumulator = (
            GroupAccumulator(
                cfg.data.train_batch_size, filtering.max_num_gen_batches, bool(filtering.carry_over), filtering.metric
            )
            if filtering.enable
            else None
        )
        self.correction = correction_settings(cfg.algorithm.rollout_correction)
        self.loss_settings = loss_settings(cfg, self.correction)
        kl = cfg.algorithm.kl_ctrl
        self.kl_controller = build_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.global_step = 0
        self.weight_version = 0
        self.generated_samples = 0
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

    # ----------------------------------------------------------------- generation
    def _next_prompt_indices(self) -> list[int]:
        if self._sampler_iter is None:
            self._sampler_iter = iter(self.sampler)
        try:
            return next(self._sampler_iter)
        except StopIteration:  # epoch finished: the next iterator starts the following epoch
            self._sampler_iter = iter(self.sampler)
            return next(self._sampler_iter)

    def _next_round(self, timer: StageTimer, round_index: int) -> RolloutBatch:
        """One generation round, scored."""
        indices = self._next_prompt_indices()
        items = [self.train_data[i] for i in indices]
        with timer("gen"):
            prompts = [it["prompt_ids"] for it in items]
            generations = self.rollout.generate(prompts, train_sampling(self.cfg), stop=self.stop_asked)
        self.generated_samples += len(items) * self.cfg.rollout.n
        uid_prefix = f"s{self.global_step}r{round_index}"
        batch = batch_from_items(items, generations, uid_prefix, self.tokenizer.pad_token_id, self.weight_version)
        with timer("reward"):
            score_batch(batch, self.reward, self.tokenizer)
        return batch

    def _collect_batch(self, timer: StageTimer) -> tuple[RolloutBatch, dict[str, float], list[int]]:
        """One round, or (dynamic sampling) rounds until train_batch_size informative groups are held.
        A stop asked for while a round generates (or before it) gives the step up: the sampler and
        the held groups go back to where the step began (:class:`StepAbandoned`), so a resumed run
        draws them again."""
        consumed: list[int] = []
        round_index = 0
        began = self._draw_state()
        while True:
            try:
                batch = self._next_round(timer, round_index)
            except GenerationStopped as stopped:
                self._load_draw_state(began)
                raise StepAbandoned(str(stopped)) from None
            consumed += sorted(set(batch["prompt_index"]))
            round_index += 1
            if self.accumulator is None:
                return batch, {}, consumed
            self.accumulator.add_round(batch)
            if self.accumulator.is_full():
                return self.accumulator.pop_batch(), self.accumulator.last_metrics, consumed
            self.accumulator.check_limit()

    def _draw_state(self) -> dict:
        """What drawing prompts changes: the sampler, dynamic sampling's held groups, the budget. Part
        of the checkpointed trainer state, and what a step given up goes back to."""
        return {
            "sampler": self.sampler.state_dict(),
            "accumulator": self.accumulator.state_dict() if self.accumulator is not None else None,
            "generated_samples": self.generated_samples,
        }

    def _load_draw_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self._sampler_iter = None
        if self.accumulator is not None and state["accumulator"] is not None:
            self.accumulator.load_state_dict(state["accumulator"])
        self.generated_samples = state.get("generated_samples", 0)  # checkpoints from before the budget existed

    # ----------------------------------------------------------------- one step
    def train_step(self) -> dict[str, float]:
        """One step in every mode (docs/algorithm.md §8): the mode's next batch, trained by
        :meth:`train_on_batch`, the new weights into the engines, the step's metrics and its
        prompts recorded. What differs between modes are the hooks: :meth:`_next_batch`,
        :meth:`_before_update`, :meth:`_sync_engines`, :meth:`_after_sync`, :meth:`_mode_metrics`
        and :meth:`_prompts_of_step`."""
        timer = StageTimer()
        step_start = time.perf_counter()
        batch, metrics = self._next_batch(timer)
        metrics.update(self._before_update(batch))
        metrics.update(self.train_on_batch(batch, timer))
        self._sync_engines(timer)
        self._after_sync()
        self._finish_step_metrics(batch, metrics, timer, step_start)
        metrics.update(self._mode_metrics(timer, time.perf_counter() - step_start))
        consumed, extra = self._prompts_of_step()
        self._record_prompts(consumed, batch, extra)
        return metrics

    # the synchronous mode's hooks
    def _next_batch(self, timer: StageTimer) -> tuple[RolloutBatch, dict[str, float]]:
        batch, metrics, self._consumed = self._collect_batch(timer)
        return batch, metrics

    def _before_update(self, batch: RolloutBatch) -> dict[str, float]:
        """Engines colocated with the training ranks sleep from the end of generation to the sync
        (a no-op otherwise)."""
        self.rollout.sleep()
        return {}

    def _sync_engines(self, timer: StageTimer) -> None:
        """The colocated engines' weights wake first, the KV cache once the new weights are in."""
        if is_colocated(self.cfg):  # the engines wake into what the update's allocator cached
            self.policy.release_memory()
        with timer("sync_weights"):
            self.rollout.wake_up(["weights"])
            self.sync_weights()
            self.rollout.wake_up(["kv_cache"])

    def _after_sync(self) -> None:
        """Nothing in the synchronous mode: the next step generates afresh."""

    def _mode_metrics(self, timer: StageTimer, step_s: float) -> dict[str, float]:
        return {mn.GENERATED_SAMPLES.name: float(self.generated_samples)}  # cumulative: the budget's axis

    def _prompts_of_step(self) -> tuple[list[int], dict | None]:
        """The dataset rows drawn this step, and what else ``prompts.jsonl`` records of it."""
        consumed, self._consumed = self._consumed, []
        return consumed, None

    def train_on_batch(self, batch: RolloutBatch, timer: StageTimer) -> dict[str, float]:
        """old_log_prob -> ref -> advantages -> update_actor: shared by the sync and stream trainers.
        Which rows the old policy's own pass scores, and which the update's first forward does,
        is :class:`~nemo_dapo.trainer.old_policy.OldPolicyScores`'s to say."""
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

    def _finish_step_metrics(self, batch: RolloutBatch, metrics: dict, timer: StageTimer, step_start: float) -> None:
        response_tokens = int(batch["response_mask"].sum())
        total_tokens = response_tokens + int(batch["prompt_mask"].sum())
        metrics.update(timing_metrics(timer.seconds, response_tokens, total_tokens))
        devices = max(cluster_gpus(self.cfg), self.policy.world_size)
        metrics.update(throughput_metrics(total_tokens, time.perf_counter() - step_start, devices))
        metrics[mn.ENGINE_RESTARTS.name] = float(self.rollout.restarts)
        if self.weight_sync.sent_bytes is not None:
            metrics[mn.WEIGHT_SYNC_MB.name] = self.weight_sync.sent_bytes / 2**20

    def sync_weights(self) -> None:
        self.weight_version += 1
        self.weight_sync(self.weight_version)

    def _current_weights(self) -> tuple[Iterator, int]:
        """The policy's weights as streamed buckets, with their version."""
        return self.policy.export_weights(WEIGHT_BUCKET_BYTES), self.weight_version

    def _record_prompts(self, consumed: list[int], batch: RolloutBatch, extra: dict | None = None) -> None:
        """Which dataset rows each step drew and trained on (audit trail for resume)."""
        with open_run_file(self.output_dir / "prompts.jsonl") as handle:
            record = {"step": self.global_step + 1, "consumed": consumed, "trained": sorted(set(batch["prompt_index"]))}
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
            **self._draw_state(),
            "kl_coef": self.kl_controller.value,
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
        self._load_draw_state(state)
        self.kl_controller.value = state["kl_coef"]
        self.initial_val = state["initial_val"]
        self.last_val = state.get("last_val", self.initial_val)  # checkpoints from before it was kept
        self.last_val_step = state.get("last_val_step")
        restore_rng(state["rng"])
        self.weight_version = state["weight_version"]
        self._restore(state)
        self.sync_weights()  # the engines started from the base model: give them the checkpoint's weights
        log.info("resumed from %s at step %d", path, self.global_step)

    def _restore(self, state: dict) -> None:
        """A mode's own part of the trainer state just loaded (:meth:`trainer_state` wrote it)."""

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
            self.output_dir, self.initial_val, self.last_val, self.global_step, self.generated_samples, took
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
