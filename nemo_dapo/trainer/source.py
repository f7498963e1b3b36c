"""Where a step's batch comes from (docs/architecture.md, "Batch sources"): the protocol the
trainer's step calls, and the prompt draws both modes share.

A mode is a batch source: the synchronous one (:mod:`~nemo_dapo.trainer.sync_source`) generates
rounds for each step; the streaming one (:mod:`~nemo_dapo.trainer.stream_source`) keeps the
engines generating and takes groups as they finish. The trainer
(:class:`~nemo_dapo.trainer.fit.DAPOTrainer`) keeps the run around them: the update, the weight
sync's call, validation, checkpoints and the stop clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.data import ResumableBatchSampler
from nemo_dapo.trainer.tracking import StageTimer


@dataclass(frozen=True)
class StepPlace:
    """Where the run is when a step asks for its batch: the steps trained so far (the batch is
    for step ``global_step + 1``), the version of the engines' weights, and whether a stop
    signal has come."""

    global_step: int
    weight_version: int
    stop_asked: Callable[[], bool]


class BatchSource(Protocol):
    """A mode, as :meth:`~nemo_dapo.trainer.fit.DAPOTrainer.train_step` calls it, in this order."""

    draws: PromptDraws

    def next_batch(self, place: StepPlace, timer: StageTimer) -> tuple[RolloutBatch, dict[str, float]]:
        """The step's batch and the metrics of getting it; raises
        :class:`~nemo_dapo.trainer.preemption.StepAbandoned` when a stop came while it generated
        (the source then holds what the step had drawn, for the checkpoint)."""
        ...

    def before_update(self, batch: RolloutBatch, weight_version: int) -> dict[str, float]:
        """What the engines do while the policy trains; metrics of the batch's age."""
        ...

    def sync(self, timer: StageTimer, sync_weights: Callable[[], None]) -> None:
        """The new weights into the engines (``sync_weights`` sends them), and what goes around it."""
        ...

    def after_sync(self) -> None:
        """What the next step's generation needs once the engines hold the new weights."""
        ...

    def metrics(self, timer: StageTimer, step_s: float) -> dict[str, float]:
        """The mode's own metrics of the step."""
        ...

    def prompts_of_step(self) -> tuple[list[int], dict | None]:
        """The dataset rows drawn this step, and what else ``prompts.jsonl`` records of it."""
        ...

    def state(self) -> dict:
        """The mode's part of the checkpointed trainer state."""
        ...

    def restore(self, state: dict, global_step: int) -> None:
        """Back to :meth:`state`'s ``state``, checkpointed after step ``global_step``."""
        ...


class PromptDraws:
    """The dataset positions each step draws (epoch after epoch, resumable), the row ids drawn
    since the last step's record, and the samples generated so far (the budget of
    ``trainer.total_generated_samples``)."""

    def __init__(self, sampler: ResumableBatchSampler, row_id: Callable[[int], int]) -> None:
        self.sampler, self.row_id = sampler, row_id
        self._iter: Iterator[list[int]] | None = None
        self.consumed: list[int] = []  # row ids drawn since take_consumed, each draw's in order
        self.generated_samples = 0

    def next_positions(self) -> list[int]:
        """One round of dataset positions; the next epoch starts when one ends."""
        if self._iter is None:
            self._iter = iter(self.sampler)
        try:
            positions = next(self._iter)
        except StopIteration:
            self._iter = iter(self.sampler)
            positions = next(self._iter)
        self.consumed += sorted(self.row_id(p) for p in positions)
        return positions

    def take_consumed(self) -> list[int]:
        consumed, self.consumed = self.consumed, []
        return consumed

    def state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "generated_samples": self.generated_samples}

    def restore(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self._iter = None
        self.consumed = []
        self.generated_samples = state.get("generated_samples", 0)  # checkpoints from before the budget existed
