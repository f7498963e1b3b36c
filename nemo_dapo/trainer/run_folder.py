"""One run per output folder: a lock while it runs, and no new run over an older one's checkpoints.

Everything a run writes (checkpoints, metrics, the W&B and MLflow run ids, the export, the
summary) lives in ``trainer.output_dir``. Two live jobs on one folder, or a fresh run
(``checkpoint.resume=disable``) in a folder that holds another run's checkpoints, would mix them:
retention would prune one run's checkpoints by the other's step numbers, the export would take
whichever is newest, the loggers would continue the wrong run. Both are refused at start-up,
with the fix named (exit 2). A requeued or resumed run is the same run: it takes the folder over.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from nemo_dapo.errors import InputError

LOCK_FILE = ".nemo_dapo.lock"


class RunFolder:
    """The claim on ``trainer.output_dir``, held until this process exits (or :meth:`release`)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.folder = Path(output_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.folder / LOCK_FILE, "a+", encoding="utf-8")
        try:
            fcntl.lockf(self._handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._handle.seek(0)
            holder = self._handle.read().strip() or "another process"
            self._handle.close()
            raise InputError(
                f"trainer.output_dir={self.folder} is in use by another run ({holder}); two runs must never "
                "share a folder: wait for it to end, or give this run another trainer.output_dir"
            ) from None
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        self._handle.flush()

    def release(self) -> None:
        self._handle.close()  # closing drops the lock


def refuse_mixing(checkpoints: list[tuple[int, Path]], resume: str, output_dir: str | Path) -> None:
    """A run that would not continue the checkpoints already in its folder is refused: they belong
    to another run. ``checkpoints``: the folder's, newest first."""
    if not checkpoints or resume == "auto":
        return
    own = {path.resolve() for _, path in checkpoints}
    if resume != "disable" and Path(resume).resolve() in own:
        return
    step, newest = checkpoints[0]
    start = "a new run" if resume == "disable" else f"a run from {resume}"
    raise InputError(
        f"trainer.output_dir={output_dir} holds the checkpoints of an earlier run (newest: {newest.name}); "
        f"checkpoint.resume={resume} would start {start} there and mix the two (retention, export, loggers). "
        "Continue that run with checkpoint.resume=auto, or give this one a new trainer.output_dir"
    )
