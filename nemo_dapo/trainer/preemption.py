"""Graceful stop on SIGUSR1 / SIGTERM, or before the job's end (``checkpoint.save_by``): finish
the step, checkpoint, exit with ``PREEMPTED_EXIT_CODE``.

Slurm warns a job before its time limit or a preemption (``#SBATCH --signal=B:USR1@600``) and
the batch script forwards the signal to the trainer (``slurm/dapo_32b.sbatch``). Stopping in the
middle of a step would lose it, so the handler only raises a flag; the training loop reads the
flag between steps (and while a step generates, which it then gives up: :class:`StepAbandoned`),
saves a checkpoint and raises :class:`Preempted`, which ``nemo-dapo train``
turns into exit code 3 so that the batch script can tell "requeue me" from a failure. A signal
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

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 3
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
PREEMPTIONS_LOG = "preemptions.jsonl"


class Preempted(Exception):
    """Training stopped (a signal, or ``checkpoint.save_by``) after step ``step``, its checkpoint
    written (none before a first step): resume with ``checkpoint.resume=auto``."""

    def __init__(self, step: int, signal_name: str) -> None:
        saved = f"after step {step} (checkpoint saved)" if step else "before a first step (nothing to save)"
        super().__init__(f"stopped by {signal_name} {saved}; rerun with checkpoint.resume=auto to continue")
        self.step = step
        self.signal_name = signal_name


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
        self._previous: dict[signal.Signals, Any] = {}  # the handlers to put back

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> PreemptionSignals:
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


def record_preemption(output_dir: Path, step: int, signal_name: str) -> None:
    """Append to ``preemptions.jsonl``: the run's history of stops, kept after it completes."""
    checkpoint = f"checkpoints/global_step_{step}" if step else None
    entry = {"step": step, "signal": signal_name, "time": time.time(), "checkpoint": checkpoint}
    with open(Path(output_dir) / PREEMPTIONS_LOG, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
    log.warning(
        "stopped by %s after step %d (its checkpoint written), exiting with code %d",
        signal_name,
        step,
        PREEMPTED_EXIT_CODE,
    )
