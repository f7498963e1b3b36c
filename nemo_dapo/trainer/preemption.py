"""Graceful stop on SIGUSR1 / SIGTERM, or before the job's end (``checkpoint.save_by``): finish
the step, checkpoint, exit with ``PREEMPTED_EXIT_CODE``.

Slurm warns a job before its time limit or a preemption (``#SBATCH --signal=B:USR1@600``) and
the batch script forwards the signal to the trainer (``slurm/dapo_32b.sbatch``). Stopping in the
middle of a step would lose it, so the handler only raises a flag; the training loop reads the
flag between steps (and while a step generates, which it then gives up: :class:`StepAbandoned`),
saves a checkpoint and raises :class:`Preempted`, which ``nemo-dapo train``
turns into exit code 3 so that the batch script can tell "requeue me" from a failure (4 when the
process stopped before finishing a step: a requeue without progress). A signal
comes at a fixed lead before the limit, which a long step may not fit; :class:`StepClock` instead
stops before starting a step that, with its checkpoint, would end past ``checkpoint.save_by``.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from nemo_dapo.folders import open_run_file

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 3
NO_PROGRESS_EXIT_CODE = 4  # stopped before finishing a step in this process: a requeue may loop
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
PREEMPTIONS_LOG = "preemptions.jsonl"


class Preempted(Exception):
    """Training stopped (a signal, or ``checkpoint.save_by``) at step ``step``, its checkpoint
    written (none before a first step): resume with ``checkpoint.resume=auto``. ``progressed``:
    whether this process finished a step; a stop without one is exit 4, which the requeue policy
    counts (a time limit too short for the start-up would otherwise requeue the job forever)."""

    def __init__(self, step: int, signal_name: str, progressed: bool = True, started_s: float = 0.0) -> None:
        if progressed:
            said = f"stopped by {signal_name} after step {step} (checkpoint saved)"
        else:
            said = (
                f"stopped by {signal_name} {started_s:.0f} s after the start, before finishing a step in this run "
                "(nothing new to save); if every run stops so, the job's time is too short for the start-up and a "
                "step: give the job more time (sbatch --time), or a smaller SAVE_MARGIN_S"
            )
        super().__init__(f"{said}; rerun with checkpoint.resume=auto to continue")
        self.step = step
        self.signal_name = signal_name
        self.progressed = progressed

    @property
    def exit_code(self) -> int:
        return PREEMPTED_EXIT_CODE if self.progressed else NO_PROGRESS_EXIT_CODE


class StepAbandoned(Exception):
    """A stop asked for while a step was still generating: the step is given up (its draws
    undone) and the last completed step is what the checkpoint keeps."""


class PreemptionSignals:
    """While active (a context manager), SIGUSR1 / SIGTERM set :attr:`received` instead of killing.

    Handlers can only be installed from the main thread; elsewhere (a trainer driven from a
    worker thread) the signals keep their previous behaviour and a warning says so.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: str | None = None
        self.since = time.time()  # when the signals began to be caught
        self._previous: dict[signal.Signals, Any] = {}  # the handlers to put back

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> PreemptionSignals:
        self.since = time.time()
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "not in the main thread: %s will not checkpoint before stopping", "/".join(s.name for s in self.signals)
            )
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name


class StepClock:
    """How long the loop's parts took lately (steps, validation, the last checkpoint), to tell
    whether one more step and its checkpoint still end before ``save_by`` (a Unix time; None: no
    deadline). A part not measured yet counts 0, so the first step always runs; with
    ``checkpoint.async_save`` only a save's blocking part is measured (the margin before the job's
    end covers the rest)."""

    def __init__(self, save_by: float | None, recent: int = 5) -> None:
        self.save_by = save_by
        self.steps: deque[float] = deque(maxlen=recent)  # seconds of the last steps (train_step)
        self.validation_s = 0.0
        self.save_s = 0.0

    def no_room(self, now: float, validating: bool) -> bool:
        """True when the slowest recent step (plus validation, when the next step runs one) and
        a checkpoint, started ``now``, would end past ``save_by``."""
        if self.save_by is None:
            return False
        needed = max(self.steps, default=0.0) + (self.validation_s if validating else 0.0) + self.save_s
        return now + needed > self.save_by


def record_preemption(output_dir: Path, stop: Preempted) -> None:
    """Append to ``preemptions.jsonl``: the run's history of stops, kept after it completes."""
    checkpoint = f"checkpoints/global_step_{stop.step}" if stop.step and stop.progressed else None
    entry = {"step": stop.step, "signal": stop.signal_name, "time": time.time(), "checkpoint": checkpoint}
    with open_run_file(Path(output_dir) / PREEMPTIONS_LOG) as handle:
        handle.write(json.dumps(entry | {"progressed": stop.progressed}) + "\n")
    saved = "its checkpoint written" if stop.progressed else "no step finished in this run"
    log.warning(
        "stopped by %s at step %d (%s), exiting with code %d", stop.signal_name, stop.step, saved, stop.exit_code
    )
