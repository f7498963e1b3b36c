"""Batch jobs on the test cluster of network namespaces (tests/test_multinode.py), seen through
scontrol and their output file."""

import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def ensure_packages(*commands: str) -> None:
    """Install the Debian packages (tools/install_slurm.sh) if a command is missing; skip if that fails."""
    if all(shutil.which(c) for c in commands):
        return
    done = subprocess.run(["bash", str(REPO / "tools" / "install_slurm.sh")], capture_output=True, text=True)
    if done.returncode != 0 or not all(shutil.which(c) for c in commands):
        pytest.skip(f"cannot install {commands} with tools/install_slurm.sh: {done.stderr[-500:]}")


class Job:
    """A submitted batch job. ``prefix`` runs a client command where the cluster's controller is
    reachable (nothing on localhost; ``setup_netns_slurm.sh exec ctl`` for the namespaces)."""

    def __init__(self, env: dict, output: Path, job_id: str, prefix: tuple[str, ...] = ()) -> None:
        self.env, self.output, self.id, self.prefix = env, output, job_id, prefix

    def run(self, *command: str) -> str:
        done = subprocess.run([*self.prefix, *command], capture_output=True, text=True, env=self.env, timeout=60)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        return done.stdout

    def field(self, name: str) -> str:
        return re.search(rf"\b{name}=(\S+)", self.run("scontrol", "show", "job", self.id)).group(1)

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def wait_for(self, what: str, condition, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            state = self.field("JobState")
            assert state not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY"), (
                f"job {self.id}: {state} (reason {self.field('Reason')}) while waiting for {what}\n{self.log()[-4000:]}"
            )
            assert time.monotonic() < deadline, (
                f"job {self.id}: no {what} after {timeout:.0f} s (state "
                f"{self.field('JobState')}, reason {self.field('Reason')})\n"
                f"{self.log()[-4000:]}"
            )
            time.sleep(0.5)

    def release_requeued(self, restarts: int, gone: Callable[[], bool] = lambda: True) -> None:
        """Start the requeued job now: Slurm may hold a requeued job for about two minutes
        (BeginTime), which also lets its last run's processes end; released at once, it must wait
        for its nodes to finish that (a node still completing the old run refuses the new one's
        credential), for ``gone``, the processes Slurm does not track (daemons the last run
        started, such as a Ray head, whose port and folder the next run reuses), and start in a
        later second than the requeue: slurmd refuses a credential made in the second its job's
        last one was revoked ("Job credential revoked", the job failed). A job Slurm started
        again on its own is left as it is."""
        self.wait_for(
            f"requeue #{restarts}",
            lambda: self.field("Restarts") == str(restarts) and self.field("JobState") in ("PENDING", "RUNNING"),
        )
        if self.field("JobState") == "RUNNING":
            return
        revoked = time.time()
        self.wait_for(
            "its nodes to finish the last run",
            lambda: not self.run("sinfo", "--noheader", "--states=completing", "--format=%N").strip() and gone(),
        )
        time.sleep(max(0.0, revoked + 2 - time.time()))
        command = [*self.prefix, "scontrol", "update", f"JobId={self.id}", "StartTime=now"]
        done = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=60)
        # the hold may have ended on its own in between: then the job is already starting
        assert done.returncode == 0 or "no longer pending" in done.stderr, done.stderr


def submit(env: dict, output: Path, script: str, overrides=(), sbatch_args=(), prefix: tuple[str, ...] = ()) -> Job:
    """``sbatch [sbatch_args] script [overrides]`` from the repository root."""
    command = [*prefix, "sbatch", "--parsable", f"--output={output}", *sbatch_args, script, *overrides]
    submitted = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    return Job(env, output, submitted.stdout.strip().split(";")[0], prefix)


def newest_checkpoint(ckpt: Path) -> int:
    folders = (ckpt / "checkpoints").glob("global_step_*")
    return max((int(p.name.rsplit("_", 1)[1]) for p in folders if p.is_dir()), default=0)


def resumed_step(log: str, restart: int) -> int:
    """The step the given restart resumed from (its "resumed from ... at step N" line)."""
    runs = log.split("dapo: restart ")
    found = re.search(r"resumed from \S+/global_step_(\d+) at step (\d+)", runs[restart + 1])
    assert found and found.group(1) == found.group(2), runs[restart + 1][-3000:]
    return int(found.group(1))
