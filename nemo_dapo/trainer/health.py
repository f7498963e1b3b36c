"""Early warnings that a run stopped learning, with the settings to look at (once per kind), and
the guard that stops a run whose optimizer steps keep being skipped for non-finite gradients.

Two collapses are common in GRPO-style training of a small model and are visible in the step
metrics long before the held-out accuracy says so:

- reward: no training sample is correct for ``STEPS`` steps in a row (``critic/acc/mean`` at 0
  after it was above 0): every group then has zero advantage, nothing is learned, and with
  dynamic sampling off the overlong shaping is the only signal left;
- length: the mean response length stays below ``LENGTH_FRACTION`` of its first steps' for
  ``STEPS`` steps: the policy is dropping its reasoning (e.g. to a bare answer line).
"""

from __future__ import annotations

import statistics

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.errors import TrainingDiverged

STEPS = 3
LENGTH_FRACTION = 0.5
START_STEPS = 3  # the length baseline: the mean of the first steps

CAUSES = (
    "dynamic sampling off (algorithm.filter_groups.enable=false): groups that are all right or all wrong carry "
    "no advantage, so most of a batch may teach nothing; soft overlong punishment with filtering off "
    "(reward.overlong_buffer) rewards shorter answers within all-wrong groups; a learning rate too high for the "
    "model (actor.optim.lr); entropy falling fast (actor/entropy; actor.clip_ratio_high)"
)


class LearningHealth:
    """Reads each step's metrics; :meth:`observe` returns the warnings due at this step."""

    def __init__(self) -> None:
        self.lengths: list[float] = []
        self.accuracies: list[float] = []
        self.warned: set[str] = set()

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        acc, length = metrics.get(mn.ACC.name), metrics.get(mn.RESPONSE_LENGTH["mean"].name)
        if acc is not None:
            self.accuracies.append(acc)
        if length is not None:
            self.lengths.append(length)
        return [warning for warning in (self._reward(step), self._length(step)) if warning]

    def _reward(self, step: int) -> str | None:
        recent = self.accuracies[-STEPS:]
        learned = any(a > 0 for a in self.accuracies[:-STEPS])
        if "reward" in self.warned or len(recent) < STEPS or not learned or any(a > 0 for a in recent):
            return None
        self.warned.add("reward")
        return (
            f"step {step}: no training sample was correct in the last {STEPS} steps (critic/acc/mean 0), after "
            f"some were: the reward collapsed, and zero-advantage groups teach nothing. Likely causes: {CAUSES}"
        )

    def _length(self, step: int) -> str | None:
        if "length" in self.warned or len(self.lengths) < START_STEPS + STEPS:
            return None
        start = statistics.mean(self.lengths[:START_STEPS])
        recent = self.lengths[-STEPS:]
        if max(recent) >= LENGTH_FRACTION * start:
            return None
        self.warned.add("length")
        return (
            f"step {step}: the mean response length stayed below {LENGTH_FRACTION:.0%} of its start "
            f"({start:.1f} -> {recent[-1]:.1f} tokens) for {STEPS} steps: the policy is dropping what it wrote "
            f"before the answer. Likely causes: {CAUSES}"
        )


class NonFiniteSteps:
    """Counts training steps in a row whose optimizer skipped a non-finite gradient (the workers
    skip such a step, so weights and optimizer state stay as they were); past ``limit`` in a row
    (``trainer.max_nonfinite_steps``; <= 0: never) the run stops, before a checkpoint of them."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_a_row = limit, 0

    def observe(self, step: int, skipped: float) -> str | None:
        """``skipped``: the fraction of this step's optimizer steps skipped. Returns the warning
        for a step that skipped any; raises :class:`TrainingDiverged` at the limit."""
        if skipped == 0:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        if 0 < self.limit <= self.in_a_row:
            raise TrainingDiverged(
                f"steps {step - self.limit + 1}-{step}: every one skipped an optimizer step for a non-finite "
                f"gradient (trainer.max_nonfinite_steps={self.limit}); stopped without checkpointing them. Look at "
                "actor/grad_norm, the learning rate, the data of these steps (prompts.jsonl) and model.dtype; "
                "resume from the last checkpoint with checkpoint.resume=auto"
            )
        stop = self.limit if self.limit > 0 else "none (trainer.max_nonfinite_steps <= 0)"
        return (
            f"step {step}: {100 * skipped:.0f}% of its optimizer steps skipped: the gradient was not finite (NaN or "
            f"Inf); weights and optimizer state are as before them ({self.in_a_row} such step(s) in a row, the run "
            f"stops at {stop})"
        )
