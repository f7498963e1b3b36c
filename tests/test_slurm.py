"""The Slurm scripts parse and pass shellcheck, the requeue policy decides as documented, and the
trainer's stop signals set its preemption flag. The scripts run for real on a multi-node Slurm in
tests/test_multinode.py."""

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from nemo_dapo.commands.bringup import bringup_checks
from nemo_dapo.trainer.preemption import PreemptionSignals, StepClock
from tests.slurm_jobs import ensure_packages

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = [
    REPO / "slurm" / "ray_cluster.sh",
    REPO / "slurm" / "ray_node.sh",
    REPO / "slurm" / "bringup_ladder.sh",
    REPO / "slurm" / "site_env.sh",
    REPO / "slurm" / "dapo_32b.sbatch",
    REPO / "slurm" / "dapo_tiny_cpu.sbatch",
    REPO / "slurm" / "requeue_policy.sh",
    REPO / "slurm" / "job_deadline.sh",
    REPO / "tests" / "slurm" / "setup_netns_slurm.sh",
    REPO / "tools" / "install_slurm.sh",
    REPO / "tools" / "install_containers.sh",
    REPO / "tools" / "install_debian.sh",
    REPO / "containers" / "build_cpu_image.sh",
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


def test_a_run_past_its_deadline_stops_before_a_step_with_the_no_progress_code(tmp_path):
    """checkpoint.save_by already past: no step starts, nothing is saved, exit 4 (no progress: the
    batch script requeues a bounded number of times), and preemptions.jsonl names the deadline."""
    from tests.train_runs import SMALL, train

    done = train(tmp_path / "run", "checkpoint.save_by=1", "trainer.total_training_steps=3", *SMALL)
    assert done.returncode == 4, done.stderr[-3000:]
    assert "stopped by checkpoint.save_by (the job's end is near) " in done.stderr
    assert "before finishing a step in this run (nothing new to save); if every run stops so, the job's time" in (
        done.stderr
    )
    (stop,) = [json.loads(line) for line in (tmp_path / "run" / "preemptions.jsonl").read_text().splitlines()]
    assert stop["step"] == 0 and stop["checkpoint"] is None and stop["signal"].startswith("checkpoint.save_by")
    assert stop["progressed"] is False
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    # the bring-up check of that run: no step is a failure, the stop is recorded, nothing else shown
    checks = {c.name: c for c in bringup_checks(tmp_path / "run")}
    assert (
        checks["steps"].passed is False
        and checks["stop"].passed
        and "step 0 by checkpoint.save_by" in checks["stop"].detail
    )
    assert checks["checkpoint"].passed is None and checks["fabric"].passed is None


def runs_engine(process: psutil.Process) -> bool:
    """Whether the process is a vLLM rollout worker (Ray titles it by its actor class)."""
    with contextlib.suppress(psutil.Error):
        return "VLLMRolloutWorker" in " ".join(process.cmdline())
    return False


def resume(pid: int) -> None:
    """SIGCONT, unless the stopping run already ended the process."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_usr1_inside_a_generation_call_gives_the_step_up_at_once(tmp_path):
    """One-token answers are all wrong, so every group's spread is 0, dynamic sampling (unbounded)
    keeps nothing and the first step generates round after round. The engine is then frozen
    (SIGSTOP), so the driver waits inside one generate call that cannot end; USR1 must still stop
    the run at once: the step given up, nothing to save before a first step, exit 4 (no progress)."""
    from tests.train_runs import CLI, ENV, SMALL

    run, err = tmp_path / "run", tmp_path / "stderr.txt"
    never_full = ["data.max_response_length=1", "reward.overlong_buffer.enable=false"]
    never_full += ["algorithm.filter_groups.max_num_gen_batches=0"]
    command = [*CLI, "train", f"trainer.output_dir={run}", *SMALL, *never_full]

    def wait_for(text: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while text not in err.read_text():
            assert trainer.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.5)

    with open(err, "w") as stderr:
        trainer = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=ENV)
        engine = None
        try:
            wait_for("DAPO:", 300)  # the loop's progress bar: generation has begun
            # this run's engine: Ray's processes descend from the trainer (another test's may run beside it)
            (engine,) = [p.pid for p in psutil.Process(trainer.pid).children(recursive=True) if runs_engine(p)]
            os.kill(engine, signal.SIGSTOP)
            time.sleep(2)  # the driver now waits for a generation the frozen engine cannot finish
            trainer.send_signal(signal.SIGUSR1)
            wait_for("the step is given up", 60)
            resume(engine)
            assert trainer.wait(timeout=120) == 4, err.read_text()[-3000:]
        finally:
            if engine is not None:
                resume(engine)
            trainer.kill()
    assert (
        "SIGUSR1 while generating step 1 (a stop came while 1 call(s) still ran): the step is given up"
        in err.read_text()
    )
    (stop,) = [json.loads(line) for line in (run / "preemptions.jsonl").read_text().splitlines()]
    assert stop == {**stop, "step": 0, "signal": "SIGUSR1", "checkpoint": None, "progressed": False}
    assert not (run / "metrics.jsonl").exists() or "update_actor" not in (run / "metrics.jsonl").read_text()


def test_the_bringup_check_reads_stage_times_a_checkpoint_and_nccls_transport(tmp_path, capsys):
    """Metrics lines as the tracker writes them, a checkpoint as the trainer commits it, and job logs
    with NCCL's transport lines (NCCL_DEBUG=INFO): IB passes, a fallback to sockets fails."""
    from nemo_dapo.cli import main
    from nemo_dapo.trainer.checkpoint import CheckpointManager

    run = tmp_path / "run"
    run.mkdir()
    stages = {"timing_s/gen": 41.5, "timing_s/old_log_prob": 7.25, "timing_s/update_actor": 30.0}
    rows = [{"step": s, **stages, "timing_s/sync_weights": 3.5, "perf/weight_sync_mb": 62464.0} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + '\n{"step": 3, "timing')  # cut short
    CheckpointManager(run / "checkpoints").save(2, lambda folder: (folder / "w.bin").write_bytes(b"x" * 4096))
    ib, socket = tmp_path / "ib.out", tmp_path / "socket.out"
    ib.write_text("n1:1234:1300 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA\n")
    socket.write_text("n1:1234:1300 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0\n")
    assert main(["bringup", str(run), "--job-log", str(ib)]) == 0
    out = capsys.readouterr().out
    assert "2 step(s), the last is step 2" in out and "sync_weights 3.50; weight sync 62464.0 MiB" in out
    assert "pass  checkpoint  step 2 complete" in out and "pass  fabric      NCCL uses NET/IB" in out
    assert main(["bringup", str(run), "--job-log", str(socket)]) == 1
    assert "FAIL  fabric      NCCL uses NET/Socket" in capsys.readouterr().out
    # a rung's requirements: a check the job does not show fails; an unknown one is a usage error
    assert main(["bringup", str(run), "--require", "steps,fabric"]) == 1
    assert "FAIL  fabric      no job log given" in capsys.readouterr().out
    assert main(["bringup", str(run), "--require", "fabrik"]) == 2
    # the stop drill: the stop after the signal, timed against the signal's lead
    stopped_at = 1_000_000.0
    stop = {"step": 2, "signal": "SIGUSR1", "time": stopped_at, "checkpoint": "checkpoints/global_step_2"}
    (run / "preemptions.jsonl").write_text(json.dumps(stop) + "\n")
    drill = ["bringup", str(run), "--require", "stop", "--signal-sent", str(stopped_at - 42.5)]
    assert main([*drill, "--stop-within", "600"]) == 0
    assert "pass  stop        step 2 by SIGUSR1; saved and stopped 42.5 s after the signal" in capsys.readouterr().out
    assert (
        main([*drill, "--stop-within", "40"]) == 1 and "more than the signal's lead of 40 s" in capsys.readouterr().out
    )
    drill[-1] = str(stopped_at + 1)  # a signal after the last stop: unanswered
    assert main(drill) == 1 and "none after the signal" in capsys.readouterr().out
    (run / "checkpoints" / "global_step_2" / "w.bin").write_bytes(b"damaged")
    assert main(["bringup", str(run)]) == 1 and "FAIL  checkpoint" in capsys.readouterr().out


def test_the_requeue_policy_bounds_runs_without_progress_and_never_requeues_a_cancelled_job(
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
    assert wanted(3) and wanted(3) and not counter.exists()  # stops after training are not crashes
    assert wanted(1) and wanted(137) and counter.read_text().split() == ["2", "0"]
    assert not wanted(1) and wanted(3)  # a third crash without progress is not requeued; a stop still is
    assert not wanted(4)  # nor is a stop before a first step: it made no progress either
    saved(6)  # the run trained on: a checkpoint since the last crash resets the count
    assert wanted(4) and counter.read_text().split() == ["1", "6"]
    assert wanted(1) and not wanted(1)  # then two requeues more without progress, as before
    saved(8)
    assert wanted(1) and counter.read_text().split() == ["1", "8"]
    # a job being cancelled (scancel: COMPLETING with no reason) is requeued after nothing
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho '   JobState=COMPLETING Reason=None Dependency=(null)'\n")
    (bin_dir / "scontrol").chmod(0o755)
    os.environ["PATH"], path = f"{bin_dir}:{os.environ['PATH']}", os.environ["PATH"]
    os.environ["SLURM_JOB_ID"] = "5"
    try:
        assert not wanted(3) and not wanted(1)
        (bin_dir / "scontrol").write_text("#!/bin/sh\necho '   JobState=COMPLETING Reason=TimeLimit'\n")
        assert wanted(3)  # the time limit's TERM: requeued
    finally:
        os.environ["PATH"] = path
        del os.environ["SLURM_JOB_ID"]


# ----------------------------------------------------------------------------- container steps
def test_podman_without_the_image_on_the_node_stops_before_any_step():
    done = subprocess.run(
        ["bash", "-c", "source slurm/ray_cluster.sh; podman() { :; }; SLURM_JOB_ID=7 SLURM_JOB_NODELIST=n1 "
         "RAY_HEAD_IP=10.0.0.1 CONTAINER=nemo-dapo:cpu CONTAINER_RUNTIME=podman LOG_DIR=$(mktemp -d); "
         "scontrol() { echo n1; }; ray_cluster_settings"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "podman has no image nemo-dapo:cpu here" in done.stderr, done.stderr


def test_stopping_the_ray_steps_survives_a_step_that_already_ended():
    """Under the batch script's `set -e`: Ray steps that ended before their signal (podman's
    containers are stopped first, which ends their steps: here a function ending the step stands
    in for podman) must not end the job with a failure."""
    script = (
        "set -euo pipefail; source slurm/ray_cluster.sh; sleep 60 & step=$!; RAY_HEAD_PID=$step; "
        'ray_cluster_stop_containers() { kill "$step"; wait "$step" || true; }; ray_cluster_stop; echo stopped'
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "stopped", done.stderr


def test_the_site_settings_reach_the_containers_and_megatron_alone_gets_one_hardware_queue(tmp_path):
    """A site's /etc/nccl.conf (invisible inside a container) is exported, a variable already set
    winning; caches go to node-local disk, not HOME; CUDA_DEVICE_MAX_CONNECTIONS=1 is no longer
    the job's (the engines keep CUDA's default) but a Megatron rank's on a GPU."""
    from nemo_dapo.config import load_config
    from nemo_dapo.trainer.assembly import policy_start_env

    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_IB_HCA=mlx5_0,mlx5_3  # adapters\n# a comment\nNCCL_IB_GID_INDEX=3\nNOT_NCCL=1\n")
    conf.write_text(conf.read_text() + "NCCL_DEBUG=WARN\n")  # given in the job's environment too: that wins
    script = "source slurm/site_env.sh; env | grep -E '^(NCCL_|NOT_NCCL|CUDA_DEVICE|HF_HOME|XDG_CACHE)' | sort"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "HF_HOME", "XDG_CACHE"))}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env | {"NCCL_CONF": str(conf),
                          "NCCL_DEBUG": "INFO", "USER": "u"}, capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "HF_HOME=/tmp/nemo-dapo-cache-u/huggingface",
        f"NCCL_CONF={conf}",
        "NCCL_DEBUG=INFO",
        "NCCL_IB_GID_INDEX=3",
        "NCCL_IB_HCA=mlx5_0,mlx5_3",
        "XDG_CACHE_HOME=/tmp/nemo-dapo-cache-u/xdg",
    ]
    megatron = load_config("dapo_qwen2.5_32b", placement=False)
    assert policy_start_env(megatron, gpus=1)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in policy_start_env(megatron, gpus=0)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in policy_start_env(load_config("tiny_cpu"), gpus=1)
