"""The Slurm scripts parse and pass shellcheck, the requeue policy decides as documented, and the
trainer's stop signals set its preemption flag. The scripts run for real on a multi-node Slurm in
tests/test_multinode.py."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nemo_dapo.trainer.preemption import PreemptionSignals, StepClock
from tests.slurm_jobs import ensure_packages

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = [
    REPO / "slurm" / "ray_cluster.sh",
    REPO / "slurm" / "dapo_32b.sbatch",
    REPO / "slurm" / "dapo_tiny_cpu.sbatch",
    REPO / "slurm" / "requeue_policy.sh",
    REPO / "tests" / "slurm" / "setup_netns_slurm.sh",
    REPO / "tools" / "install_slurm.sh",
]


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


def test_a_job_on_several_nodes_names_the_site_paths_it_lacks_before_writing_anything(tmp_path):
    """CKPT_DIR, DATA_DIR, HF_MODEL and CONTAINER (or CONTAINER=none) must be set on more than one
    node, and CKPT_DIR not inside the checkout: exit 2 (never requeued) naming them, nothing made."""
    site = ("CKPT_DIR", "DATA_DIR", "HF_MODEL", "CONTAINER", "LOG_DIR")
    env = {k: v for k, v in os.environ.items() if k not in site} | {"SLURM_JOB_NUM_NODES": "2", "REPO_DIR": str(REPO)}

    def submitted(**given: str) -> subprocess.CompletedProcess:
        script = REPO / "slurm" / "dapo_32b.sbatch"
        return subprocess.run(["bash", str(script)], env=env | given, capture_output=True, text=True, timeout=60)

    done = submitted(DATA_DIR=str(tmp_path / "data"))
    assert done.returncode == 2 and "needs CKPT_DIR HF_MODEL CONTAINER set" in done.stderr, done.stderr
    inside = REPO / "outputs" / "site-paths-test"
    done = submitted(CKPT_DIR=str(inside), DATA_DIR="/d", HF_MODEL="/m", CONTAINER="none")
    assert done.returncode == 2 and "is inside the checkout" in done.stderr, done.stderr
    assert not inside.exists() and not (tmp_path / "data").exists()
    # the tiny CPU wrapper names its own: only CKPT_DIR is the submitter's to give
    done = subprocess.run(
        ["bash", str(REPO / "slurm" / "dapo_tiny_cpu.sbatch")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "needs CKPT_DIR set" in done.stderr, done.stderr


def test_the_test_cluster_refuses_a_state_folder_someone_else_could_have_made(tmp_path):
    """setup_netns_slurm.sh trusts the munge key and slurm.conf in its state folder: one not
    root's with mode 0700 (here: mode 0755, then another user's, then a link) is refused before
    anything starts or is written there."""
    ensure_packages("munged", "slurmctld", "slurmd", "sinfo")
    script = REPO / "tests" / "slurm" / "setup_netns_slurm.sh"
    state, target = tmp_path / "state", tmp_path / "elsewhere"
    state.mkdir(mode=0o755)
    target.mkdir(mode=0o700)
    for case in ("mode", "owner", "link"):
        if case == "owner":
            state.chmod(0o700)
            os.chown(state, 65534, 65534)
        elif case == "link":
            state.rmdir()
            state.symlink_to(target)
        done = subprocess.run(
            ["bash", str(script), "start"],
            env={**os.environ, "NETNS_SLURM_DIR": str(state)},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 1 and f"{state}: not a folder of root's with mode 0700" in done.stderr, done.stderr
        assert not list(target.iterdir()) and (case == "link" or not list(state.iterdir()))


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


def test_the_clock_refuses_a_step_that_would_not_end_and_save_before_the_deadline():
    """checkpoint.save_by: the slowest of the last 5 steps, the validation when due and the last
    save, from now; nothing measured counts 0 (the first step runs); no deadline, no stop."""
    clock = StepClock(save_by=1000.0)
    assert not clock.no_room(999.0, validating=True) and clock.no_room(1000.5, validating=False)
    clock.steps.extend([10.0, 30.0, 20.0])
    clock.validation_s, clock.save_s = 100.0, 50.0
    assert not clock.no_room(920.0, validating=False)  # 920 + 30 + 50 = 1000
    assert clock.no_room(921.0, validating=False) and clock.no_room(920.0, validating=True)
    clock.steps.extend([1.0] * 5)  # the slow steps leave the window
    assert not clock.no_room(949.0, validating=False)
    assert not StepClock(save_by=None).no_room(1e12, validating=True)


def test_a_run_past_its_deadline_stops_before_a_step_with_the_requeue_code(tmp_path):
    """checkpoint.save_by already past: no step starts, nothing is saved, exit 3 (the batch script
    requeues), and preemptions.jsonl names the deadline."""
    import json

    from tests.train_runs import SMALL, train

    done = train(tmp_path / "run", "checkpoint.save_by=1", "trainer.total_training_steps=3", *SMALL)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "stopped by checkpoint.save_by (the job's end is near) before a first step" in done.stderr
    (stop,) = [json.loads(line) for line in (tmp_path / "run" / "preemptions.jsonl").read_text().splitlines()]
    assert stop["step"] == 0 and stop["checkpoint"] is None and stop["signal"].startswith("checkpoint.save_by")
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_the_requeue_policy_requeues_stops_always_crashes_twice_without_progress_and_invalid_configs_never(
    tmp_path,
):
    """slurm/requeue_policy.sh, which the batch script and NeMo-Run's script both ask."""
    counter = tmp_path / "logs" / "crash_requeues"
    checkpoints = tmp_path / "out" / "checkpoints"
    checkpoints.mkdir(parents=True)

    def wanted(status: int) -> bool:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", f"source slurm/requeue_policy.sh && requeue_wanted {status}"],
            cwd=REPO,
            env={
                **os.environ,
                "CRASH_COUNT_FILE": str(counter),
                "MAX_CRASH_REQUEUES": "2",
                "CHECKPOINTS_DIR": str(checkpoints),
            },
            capture_output=True,
            text=True,
        )
        assert "No such file" not in done.stderr, done.stderr
        return done.returncode == 0

    def saved(step: int) -> None:
        (checkpoints / "latest").write_text(f"global_step_{step}")

    assert not wanted(0) and not wanted(2)  # finished; an invalid config fails the same way each time
    assert wanted(3) and wanted(3) and not counter.exists()  # stops are not crashes
    assert wanted(1) and wanted(137) and counter.read_text().split() == ["2", "0"]
    assert not wanted(1) and wanted(3)  # a third crash without progress is not requeued; a stop still is
    saved(6)  # the run trained on: a checkpoint since the last crash resets the count
    assert wanted(1) and counter.read_text().split() == ["1", "6"]
    assert wanted(1) and not wanted(1)  # then two crashes more without progress, as before
    saved(8)
    assert wanted(1) and counter.read_text().split() == ["1", "8"]
