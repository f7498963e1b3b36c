"""Slurm for real: the batch scripts of slurm/ on a single-node Slurm started on localhost.

``tests/slurm/setup_local_slurm.sh`` runs munged, slurmctld and slurmd (root, no systemd, no
cgroups, every daemon on 127.0.0.1). One job of ``slurm/dapo_tiny_cpu.sbatch`` then lives the
life of a long run on a cluster: a stop signal as ``--signal=B:USR1@...`` sends it before the
time limit (the trainer checkpoints, exits 3, the script requeues the job), an outside
``scontrol requeue`` (node failure, admin), and each restart resumes from the newest checkpoint
until the run completes with every step trained exactly once. Also: ``bash -n`` + shellcheck of
every script, and the trainer's preemption flag.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_dapo.trainer.preemption import PreemptionSignals

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = [
    REPO / "slurm" / "ray_cluster.sh",
    REPO / "slurm" / "dapo_32b.sbatch",
    REPO / "slurm" / "dapo_tiny_cpu.sbatch",
    REPO / "tests" / "slurm" / "setup_local_slurm.sh",
    REPO / "tools" / "install_slurm.sh",
]
SLURM_DIR = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/nemo-dapo-slurm"))
TOTAL_STEPS = 40  # long enough that the resumed run is still going when the test requeues it
TRAIN_OVERRIDES = [
    f"trainer.total_training_steps={TOTAL_STEPS}",
    "trainer.save_freq=2",
    "data.train_batch_size=8",
    "data.gen_batch_size=12",
    "actor.ppo_mini_batch_size=4",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
]


def ensure_packages(*commands: str) -> None:
    """Install the Debian packages (tools/install_slurm.sh) if a command is missing; skip if that fails."""
    if all(shutil.which(c) for c in commands):
        return
    done = subprocess.run(["bash", str(REPO / "tools" / "install_slurm.sh")], capture_output=True, text=True)
    if done.returncode != 0 or not all(shutil.which(c) for c in commands):
        pytest.skip(f"cannot install {commands} with tools/install_slurm.sh: {done.stderr[-500:]}")


# ----------------------------------------------------------------------------- scripts
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_passes_shellcheck(script):
    ensure_packages("shellcheck")
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    checked = subprocess.run(
        ["shellcheck", "-x", str(script.relative_to(REPO))], capture_output=True, text=True, cwd=REPO
    )
    assert checked.returncode == 0, checked.stdout


# ----------------------------------------------------------------------------- preemption flag
def test_stop_signals_set_the_flag_instead_of_killing():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionSignals() as preemption:
        assert not preemption.requested
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)  # handlers run between bytecodes of the main thread
        assert preemption.requested and preemption.received == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before


# ----------------------------------------------------------------------------- a real Slurm
@pytest.fixture(scope="module")
def slurm_env():
    """Environment for Slurm clients and jobs: SLURM_CONF of the local cluster, this interpreter first on PATH."""
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start jobs")
    ensure_packages("slurmctld", "slurmd", "munged", "sbatch")
    setup = REPO / "tests" / "slurm" / "setup_local_slurm.sh"
    started = subprocess.run(["bash", str(setup), "start"], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr + _daemon_logs()
    env = {
        **os.environ,
        "SLURM_CONF": str(SLURM_DIR / "slurm.conf"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHON": sys.executable,
    }
    yield env
    subprocess.run(["bash", str(setup), "stop"], capture_output=True, timeout=120)


def _daemon_logs() -> str:
    return "".join(f"\n--- {p}\n{p.read_text()[-2000:]}" for p in sorted((SLURM_DIR / "log").glob("*.log")))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Job:
    """A submitted batch job, seen through scontrol and its output file."""

    def __init__(self, env: dict, output: Path, job_id: str) -> None:
        self.env, self.output, self.id = env, output, job_id

    def run(self, *command: str) -> str:
        done = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=60)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        return done.stdout

    def field(self, name: str) -> str:
        return re.search(rf"\b{name}=(\S+)", self.run("scontrol", "show", "job", self.id)).group(1)

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def wait_for(self, what: str, condition, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, (
                f"job {self.id}: no {what} after {timeout:.0f} s (state "
                f"{self.field('JobState')}, reason {self.field('Reason')})\n"
                f"{self.log()[-4000:]}"
            )
            time.sleep(0.5)

    def release_requeued(self, restarts: int) -> None:
        """Start the requeued job now: Slurm holds a requeued job for about two minutes (BeginTime)."""
        self.wait_for(
            f"requeue #{restarts}",
            lambda: self.field("Restarts") == str(restarts) and self.field("JobState") == "PENDING",
        )
        self.run("scontrol", "update", f"JobId={self.id}", "StartTime=now")


def submit_tiny_job(env: dict, tmp_path: Path) -> Job:
    job_env = {
        **env,
        "CKPT_DIR": str(tmp_path / "ckpt"),
        "LOG_DIR": str(tmp_path / "logs"),
        "RAY_PORT": str(free_port()),
    }
    output = tmp_path / "job.out"
    command = ["sbatch", "--parsable", f"--output={output}", "slurm/dapo_tiny_cpu.sbatch", *TRAIN_OVERRIDES]
    submitted = subprocess.run(command, capture_output=True, text=True, env=job_env, cwd=REPO, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    return Job(env, output, submitted.stdout.strip().split(";")[0])


def newest_checkpoint(ckpt: Path) -> int:
    folders = (ckpt / "checkpoints").glob("global_step_*")
    return max((int(p.name.rsplit("_", 1)[1]) for p in folders if p.is_dir()), default=0)


def resumed_step(log: str, restart: int) -> int:
    """The step the given restart resumed from (its "resumed from ... at step N" line)."""
    runs = log.split("dapo: restart ")
    found = re.search(r"resumed from \S+/global_step_(\d+) at step (\d+)", runs[restart + 1])
    assert found and found.group(1) == found.group(2), runs[restart + 1][-3000:]
    return int(found.group(1))


@pytest.mark.slow
def test_tiny_job_survives_stop_signal_and_requeue(slurm_env, tmp_path):
    job = submit_tiny_job(slurm_env, tmp_path)
    ckpt = tmp_path / "ckpt"
    started = time.monotonic()
    try:
        # 1. the time-limit warning: the batch shell gets USR1, the trainer checkpoints and exits 3
        job.wait_for("first checkpoint", lambda: (ckpt / "checkpoints" / "global_step_2").is_dir())
        job.run("scancel", "--batch", "--signal=USR1", job.id)
        job.release_requeued(restarts=1)
        stop = json.loads((ckpt / "preemptions.jsonl").read_text().splitlines()[0])
        assert stop["signal"] == "SIGUSR1" and stop["step"] >= 2, stop
        log = job.log()
        assert f"preempted by SIGUSR1: checkpoint of step {stop['step']} saved, exiting with code 3" in log
        assert "dapo: stopped with a checkpoint; requeueing job" in log
        # 2. the requeued job resumes from that checkpoint; then Slurm requeues it from outside
        job.wait_for("resume after USR1", lambda: "resumed from" in job.log())
        assert resumed_step(job.log(), restart=1) == stop["step"]
        next_save = stop["step"] + 2
        # any checkpoint at or past next_save: with keep_last a given folder may already be pruned
        job.wait_for("a checkpoint after the resume", lambda: newest_checkpoint(ckpt) >= next_save)
        assert job.field("JobState") == "RUNNING", "the resumed run finished before it could be requeued"
        job.run("scontrol", "requeue", job.id)
        job.release_requeued(restarts=2)
        # 3. the second restart resumes from the newest checkpoint and completes the run
        job.wait_for("completion", lambda: job.field("JobState") == "COMPLETED", timeout=180)
    finally:
        subprocess.run(["scancel", job.id], env=slurm_env, capture_output=True)
        shutil.rmtree(f"/tmp/ray_{job.id}", ignore_errors=True)
    log = job.log()
    assert job.field("ExitCode") == "0:0" and job.field("Restarts") == "2"
    assert resumed_step(log, restart=2) >= next_save
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS
    assert (ckpt / "checkpoints" / f"global_step_{TOTAL_STEPS}").is_dir() and (ckpt / "hf_export").is_dir()
    trained_steps = {json.loads(line)["step"] for line in (ckpt / "prompts.jsonl").read_text().splitlines()}
    assert trained_steps == set(range(1, TOTAL_STEPS + 1))
    assert sorted(p.name for p in (tmp_path / "logs" / job.id).glob("ray-head.r*.log")) == [
        "ray-head.r0.log",
        "ray-head.r1.log",
        "ray-head.r2.log",
    ]
    print(
        f"slurm job {job.id}: USR1 stop at step {stop['step']}, requeue, {TOTAL_STEPS} steps in "
        f"{time.monotonic() - started:.0f} s"
    )
