"""One run per output folder: a lock while it runs, and no new run over an older one's checkpoints.

Everything a run writes (checkpoints, metrics, the W&B and MLflow run ids, the export, the
summary) lives in ``trainer.output_dir``. Two live jobs on one folder, or a fresh run
(``checkpoint.resume=disable``) in a folder that holds another run's checkpoints, would mix them:
retention would prune one run's checkpoints by the other's step numbers, the export would take
whichever is newest, the loggers would continue the wrong run. Both are refused at start-up,
with the fix named (exit 2). A requeued or resumed run is the same run: it takes the folder over,
waiting a bounded time for the previous run of its Slurm job to let go.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from nemo_dapo.errors import InputError
from nemo_dapo.folders import open_run_file

LOCK_FILE = ".nemo_dapo.lock"


# lockf errors of a file system without working POSIX locks (Lustre with noflock, NFS with nolock)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# an ENOLCK is tried this many times, this far apart, before the file system is said to have no locks
LOCK_TRIES, LOCK_RETRY_S = 4, 0.5
# how long a requeued run waits for the previous run of its Slurm job to let go of the folder
SAME_JOB_WAIT_S = 120.0


class RunFolder:
    """The claim on ``trainer.output_dir``, held until this process exits (or :meth:`release`)."""

    def __init__(self, output_dir: str | Path, same_job_wait_s: float = SAME_JOB_WAIT_S) -> None:
        self.folder = Path(output_dir)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as err:
            raise InputError(
                f"trainer.output_dir={self.folder}: a file is in the way of the folder ({err.strerror}: "
                f"{err.filename}); give trainer.output_dir a folder path (new, or a run's), or move the file away"
            ) from None
        self._handle = open_run_file(self.folder / LOCK_FILE, "a+")  # a planted link is refused, not truncated
        job = os.environ.get("SLURM_JOB_ID")
        deadline = time.monotonic() + same_job_wait_s
        while not self._try_lock():
            holder = self._holder()
            same_job = job is not None and f"(Slurm job {job})" in holder
            if not same_job or time.monotonic() > deadline:
                self._handle.close()
                raise self._held_error(holder, same_job, same_job_wait_s)
            time.sleep(1.0)
        self._handle.seek(0)
        self._handle.truncate()
        in_job = f" (Slurm job {job})" if job else ""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {stamp}{in_job}")
        self._handle.flush()

    def _try_lock(self) -> bool:
        """Whether the lock was taken; False while another process holds it."""
        error = self._lock_error()
        if error is None:
            return True
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        self._handle.close()
        if error.errno in NO_LOCKS:
            raise InputError(self._no_locks_message(error)) from None
        raise error

    def _lock_error(self) -> OSError | None:
        """Why the lock was not taken (None: it was). An ENOLCK is tried again a few times first: it
        can be passing (NFS's lock manager briefly out of locks, or restarting)."""
        error: OSError | None = None
        for attempt in range(LOCK_TRIES):
            if attempt:
                time.sleep(LOCK_RETRY_S)
            try:
                fcntl.lockf(self._handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return None
            except OSError as err:
                error = err
                if err.errno != errno.ENOLCK:
                    break
        return error

    def _holder(self) -> str:
        self._handle.seek(0)
        return self._handle.read().strip() or "another process"

    def _held_error(self, holder: str, same_job: bool, waited_s: float) -> Exception:
        if same_job:
            # not exit 2: the batch script requeues a crash, and the next run may find the folder free
            return RuntimeError(
                f"trainer.output_dir={self.folder} is still held by an earlier run of this Slurm job ({holder}) "
                f"after {waited_s:g} s: its trainer has not exited; stop it (scancel or kill the pid)"
            )
        return InputError(
            f"trainer.output_dir={self.folder} is in use by another run ({holder}); two runs must never "
            "share a folder: wait for it to end, or give this run another trainer.output_dir"
        )

    def _no_locks_message(self, err: OSError) -> str:
        mount, fstype = mount_of(self.folder)
        return (
            f"trainer.output_dir={self.folder} is on a file system without working POSIX locks ({mount}, {fstype}: "
            f"{os.strerror(err.errno or 0)}); the run lock that keeps two runs off one folder needs them. Put "
            "trainer.output_dir on a file system every node locks consistently (Lustre mounted with -o flock, "
            "NFS without nolock), or ask the cluster's admins for one"
        )

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


def mount_of(path: Path) -> tuple[str, str]:
    """The mount point holding ``path`` and its file system type (from /proc/self/mounts)."""
    path = path.resolve()
    mounts = {}
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            mounts[fields[1].replace("\\040", " ")] = fields[2]
    except OSError:
        return str(path), "unknown type"
    for folder in (path, *path.parents):
        if str(folder) in mounts:
            return str(folder), mounts[str(folder)]
    return "/", mounts.get("/", "unknown type")
