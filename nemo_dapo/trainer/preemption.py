"""Graceful stop on SIGUSR1 / SIGTERM: finish the step, checkpoint, exit with ``PREEMPTED_EXIT_CODE``.

Slurm warns a job before its time limit or a preemption (``#SBATCH --signal=B:USR1@600``) and
the batch script forwards the signal to the trainer (``slurm/dapo_32b.sbatch``). Stopping in the
middle of a step would lose it, so the handler only raises a flag; the training loop reads the
flag between steps, saves a checkpoint and raises :class:`Preempted`, which ``nemo-dapo train``
turns into exit code 3 so that the batch script can tell "requeue me" from a failure.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 3
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
PREEMPTIONS_LOG = "preemptions.jsonl"


class Preempted(Exception):
    """Training stopped on a signal after a checkpoint of ``step``: resume with ``checkpoint.resume=auto``."""

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(
            f"stopped by {signal_name} after step {step} (checkpoint saved); "
            "rerun with checkpoint.resume=auto to continue"
        )
        self.step = step
        self.signal_name = signal_name


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


def record_preemption(output_dir: Path, step: int, signal_name: str) -> None:
    """Append to ``preemptions.jsonl``: the run's history of stops, kept after it completes."""
    entry = {"step": step, "signal": signal_name, "time": time.time(), "checkpoint": f"checkpoints/global_step_{step}"}
    with open(Path(output_dir) / PREEMPTIONS_LOG, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
    log.warning(
        "preempted by %s: checkpoint of step %d saved, exiting with code %d", signal_name, step, PREEMPTED_EXIT_CODE
    )
