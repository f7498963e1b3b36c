"""The asynchronous DAPO trainer: generation overlaps training through a data plane.

Prompts and their samples travel through the data plane (``prompt_queue.py`` holds that
protocol). While the policy trains on one batch, the engines already generate the next with
the previous weights; one
trainer step is ``parameter_sync_step`` local updates, then a weight sync. A round is generated
with the weights of the sync before the one that precedes its training, so every trajectory
lags the policy by exactly one version (``max_staleness >= 1``) or none (``max_staleness=0``:
no overlap, generation and training take turns); nothing can grow older, so nothing is dropped.
The local update itself is the synchronous trainer's (``train_on_batch``): one step
implementation for both loops.
"""

from __future__ import annotations

import logging
import time

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.metrics import staleness_metrics
from nemo_dapo.safe_load import load_state
from nemo_dapo.trainer.batching import batch_from_items
from nemo_dapo.trainer.checkpoint import TRAINER_STATE
from nemo_dapo.trainer.data_plane import DataPlane
from nemo_dapo.trainer.fit import DAPOTrainer
from nemo_dapo.trainer.prompt_queue import PromptQueue
from nemo_dapo.trainer.stages import score_batch
from nemo_dapo.trainer.tracking import StageTimer

log = logging.getLogger(__name__)


class AsyncDAPOTrainer(DAPOTrainer):
    """The one-round-ahead trainer: while the policy trains on round k, the engines generate round
    k+1 with the weights of the step before (``trainer.mode=async``). Replaces :meth:`train_step`,
    :meth:`_next_round` and the checkpointed state of :class:`DAPOTrainer` (its hook contract),
    nothing else."""

    def __init__(self, *args, plane: DataPlane, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.queue = PromptQueue(plane, self.rollout)
        self.reissued = 0
        self.overlap = self.cfg.trainer.max_staleness > 0

    # ----------------------------------------------------------------- rounds through the data plane
    def _launch_generation(self) -> None:
        """Send a round of pending prompts (issuing the next ones if none wait) to the engines."""
        if self.queue.inflight is not None:
            return
        if not self.queue.has_pending():
            self.queue.issue([self.train_data[i] for i in self._next_prompt_indices()], self.global_step)
        self.queue.launch(self.sampler.batch_size, self._sampling(), self.weight_version)

    def _finished_groups(self, round_index: int) -> RolloutBatch:
        """The finished prompts as a batch."""
        finished = self.queue.take_finished()
        if not finished:
            return RolloutBatch()
        return batch_from_items(
            [p.item for p in finished],
            [p.generation for p in finished],
            f"s{self.global_step}r{round_index}",
            self.tokenizer.pad_token_id,
            [p.policy_version for p in finished],
            extra={"prompt_key": [p.key for p in finished], "attempt": [p.attempt for p in finished]},
        )

    def _next_round(self, timer: StageTimer, round_index: int) -> RolloutBatch:
        """A round from the data plane: harvest the in-flight generation (launching it if none)."""
        while True:
            with timer("gen"):
                self._launch_generation()
                self.reissued += self.queue.harvest(self.global_step)
            batch = self._finished_groups(round_index)
            if len(batch):
                break
        self.generated_samples += len(batch)
        with timer("reward"):
            score_batch(batch, self.reward, self.tokenizer)
        return batch

    # ----------------------------------------------------------------- one trainer step
    def train_step(self) -> dict[str, float]:
        """``parameter_sync_step`` local updates, each overlapping the next generation, then a sync."""
        timer = StageTimer()
        step_start = time.perf_counter()
        collected: list[dict[str, float]] = []
        batches, consumed = [], []
        for _ in range(self.cfg.trainer.parameter_sync_step):
            batch, metrics, round_consumed = self._collect_batch(timer)
            if self.overlap:
                with timer("gen"):
                    self._launch_generation()  # runs on the engines while the policy trains
            versions = batch["policy_version"].tolist()
            metrics.update(staleness_metrics(versions, self.weight_version))
            metrics.update(self.train_on_batch(batch, timer))
            collected.append(metrics)
            batches.append(batch)
            consumed += round_consumed
        with timer("sync_weights"):
            self.sync_weights()
        metrics = mn.combine_steps({k: [m[k] for m in collected if k in m] for k in collected[-1]})
        metrics[mn.REISSUED_PROMPTS.name] = float(self.reissued)
        metrics[mn.GENERATED_SAMPLES.name] = float(self.generated_samples)
        batch = RolloutBatch.concat(batches)
        self._finish_step_metrics(batch, metrics, timer, step_start)
        self._record_prompts(consumed, batch)
        return metrics

    # ----------------------------------------------------------------- checkpoints
    def trainer_state(self) -> dict:
        return {**super().trainer_state(), **self.queue.snapshot()}

    def load_checkpoint(self, path) -> None:

        super().load_checkpoint(path)
        self.reissued = self.queue.restore(load_state(path / TRAINER_STATE), self.global_step)
        log.info("reissued %d in-flight prompts after restore", self.reissued)
