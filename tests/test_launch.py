"""`nemo-dapo launch` through NeMo-Run: the Slurm batch script it would submit, and a real local run.

The Slurm dry run packages the code and renders the script without connecting anywhere (the SSH
host below is in the reserved ``.invalid`` domain); the local run trains the tiny preset to the end.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nemo_run", reason="NeMo-Run is the `launch` extra: pip install nemo-run==0.11.1 leptonai==0.27.3")

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "nemo_dapo.cli"]


def launch(*arguments: str, home: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "NEMORUN_HOME": str(home),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [*CLI, "launch", *arguments], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


def test_slurm_dryrun_prints_the_complete_batch_script(tmp_path):
    done = launch(
        "--config",
        "dapo_qwen2.5_32b",
        "--executor",
        "slurm",
        "--dryrun",
        "--nodes",
        "16",
        "--gpus-per-node",
        "8",
        "--time",
        "12:00:00",
        "--account",
        "llm",
        "--partition",
        "batch",
        "--container-image",
        "nvcr.io/acme/nemo-dapo:1.0",
        "--data-dir",
        "/lustre/data",
        "--hf-model",
        "/lustre/models/Qwen2.5-32B",
        "--ssh-host",
        "login.cluster.invalid",
        "--ssh-user",
        "alice",
        "--remote-job-dir",
        "/lustre/alice/nemo-run",
        "trainer.experiment_name=dapo 32b",
        home=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    script = done.stdout[done.stdout.index("#!/bin/bash") :]
    for flag in (
        "--nodes=16",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--exclusive",
        "--time=12:00:00",
        "--account=llm",
        "--partition=batch",
        "--signal=USR1@600",
        "--job-name=nemo-dapo-dapo_qwen2.5_32b-train",
    ):
        assert f"#SBATCH {flag}\n" in script, flag
    # Ray over the allocation (the sbatch script's ray_cluster.sh), then the trainer once on the head node
    # a start-up that fails goes through the requeue policy; once Ray is up, only the cleanup
    setup = script.index("source slurm/ray_cluster.sh\n")
    assert script[setup:].startswith(
        "source slurm/ray_cluster.sh\ntrap 'STOP_SIGNAL=TERM' TERM  # the batch shell lives on to decide about the "
        "requeue\ntrap 'startup_exit $?' EXIT\nray_cluster_start\ntrap job_cleanup EXIT\n"
    )
    srun = re.search(r"^srun .*$", script[setup:], re.MULTILINE).group(0)
    # the trainer joins the node's named container (made by ray_cluster_start), with the Ray folder and the CPUs
    assert ",${RAY_TEMP_DIR}:${RAY_TEMP_DIR}," in srun and "#SBATCH --dependency=singleton\n" in script
    code_dir = re.search(r"^cd (\S+/train/code)$", script, re.MULTILINE).group(1)
    assert code_dir.startswith("/lustre/alice/nemo-run/nemo-dapo-dapo_qwen2.5_32b/")
    assert "--container-image nvcr.io/acme/nemo-dapo:1.0" in srun and "--container-workdir /nemo_run/code" in srun
    assert (
        "--nodes=1 --ntasks=1 --overlap --relative=0 --cpus-per-task=${SLURM_CPUS_ON_NODE} "
        "--container-name=nemo-dapo-${SLURM_JOB_ID} python3 -m nemo_dapo.cli train --config dapo_qwen2.5_32b" in srun
    )
    for override in (
        "trainer.output_dir=/lustre/alice/nemo-run/nemo-dapo-dapo_qwen2.5_32b/outputs",
        "checkpoint.resume=auto",
        "trainer.nnodes=16",
        "trainer.n_gpus_per_node=8",
        "'trainer.experiment_name=dapo 32b'",
    ):
        assert f" {override}" in srun, override
    mounts = re.search(r"^export CONTAINER_MOUNTS=(\S+)$", script, re.MULTILINE).group(1).split(",")
    assert {
        "/lustre/alice/nemo-run:/lustre/alice/nemo-run",
        "/lustre/data:/lustre/data",
        f"{code_dir[: -len('/code')]}:/nemo_run",
    } <= set(mounts)
    for export in (
        "export CONTAINER=nvcr.io/acme/nemo-dapo:1.0",
        "export DAPO_DATA_DIR=/lustre/data",
        "export HF_MODEL=/lustre/models/Qwen2.5-32B",
        "export RAY_GPUS_PER_NODE=8",
    ):
        assert f"{export}\n" in script, export
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script and "export TORCHX_MAX_RETRIES=20" in script
    parsed = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    assert not list(tmp_path.rglob("*_sbatch.sh")), "a dry run leaves no experiment behind"


def test_slurm_allocation_defaults_to_the_presets_shape(tmp_path):
    done = launch("--config", "dapo_qwen2.5_32b", "--executor", "slurm", "--dryrun", home=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "#SBATCH --nodes=16\n" in done.stdout and "#SBATCH --gpus-per-node=8\n" in done.stdout
    assert " trainer.nnodes=16 trainer.n_gpus_per_node=8 actor.num_workers=128" in done.stdout
    on_cpus = launch("--config", "tiny_cpu", "--executor", "slurm", "--dryrun", home=tmp_path)
    assert on_cpus.returncode == 0, on_cpus.stderr[-3000:]
    assert "#SBATCH --nodes=1\n" in on_cpus.stdout and "--gpus-per-node" not in on_cpus.stdout


def test_the_batch_script_requeues_preemptions_and_a_few_crashes_never_an_invalid_config(tmp_path):
    done = launch(
        "--config",
        "dapo_qwen2.5_32b",
        "--executor",
        "slurm",
        "--dryrun",
        "--max-crash-restarts",
        "2",
        home=tmp_path / "home",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    script = done.stdout
    policy = re.search(r"^# nemo-dapo's requeue policy.*?^\}$", script, re.MULTILINE | re.DOTALL).group(0)
    requeue = re.search(r"^if \[ \$exitcode -ne 0 \]; then\n.*?^fi$", script, re.MULTILINE | re.DOTALL).group(0)
    assert script.index(policy) < script.index(requeue)  # defined before NeMo-Run's requeue block runs
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$1" != requeue ] || echo "$@" >> "$SCONTROL_LOG"\n')
    (bin_dir / "scontrol").chmod(0o755)
    log = tmp_path / "scontrol.log"

    def job_ends_with(code: int, restart: int) -> bool:
        """Run the script's own policy and requeue block after an exit ``code``; True if it requeued."""
        before = log.read_text() if log.exists() else ""
        env = {
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SCONTROL_LOG": str(log),
            "LOG_DIR": str(tmp_path / "logs"),
            "SLURM_JOB_ID": "42",
            "SLURM_RESTART_COUNT": str(restart),
            "TORCHX_MAX_RETRIES": "20",
        }
        ended = subprocess.run(
            ["bash", "-c", f"source slurm/requeue_policy.sh\n{policy}\nexitcode={code}\n{requeue}"],
            env=env,
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert ended.returncode == code, ended.stderr
        return (log.read_text() if log.exists() else "") != before

    assert not job_ends_with(2, restart=0)  # an invalid config fails the same way every time
    assert job_ends_with(3, restart=0) and job_ends_with(3, restart=1)  # preempted: resumes from its checkpoint
    assert job_ends_with(1, restart=2) and job_ends_with(137, restart=3)  # two crashes are requeued...
    assert not job_ends_with(1, restart=4)  # ...the third is not
    assert job_ends_with(3, restart=4) and not job_ends_with(3, restart=20)  # --max-restarts bounds them all
    assert log.read_text().splitlines()[0] == "requeue 42"


def test_a_cluster_path_that_nemo_run_would_rewrite_is_refused(tmp_path):
    """NeMo-Run replaces every /nemo_run in its batch script by the job's folder."""
    done = launch("--executor", "slurm", "--dryrun", home=tmp_path / "nemo_run")
    assert done.returncode == 2 and "contains /nemo_run, which NeMo-Run rewrites" in done.stderr, done.stderr[-2000:]


def test_invalid_config_fails_before_anything_is_launched(tmp_path):
    done = launch("--executor", "slurm", "--dryrun", "actor.clip_ratio_c=0.5", home=tmp_path)
    assert done.returncode == 2 and "actor.clip_ratio_c" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_local_executor_trains_the_tiny_preset(tmp_path):
    out = tmp_path / "run"
    done = launch(
        "--executor",
        "local",
        "--ckpt-dir",
        str(out),
        "trainer.total_training_steps=3",
        "trainer.save_freq=3",
        "data.train_batch_size=8",
        "data.gen_batch_size=12",
        "actor.ppo_mini_batch_size=4",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        home=tmp_path / "nemo_run",
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"local run SUCCEEDED; outputs in {out}" in done.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert (out / "checkpoints" / "global_step_3").is_dir()
