"""The batch scripts on a site of 16 nodes x 8 GPUs with pyxis, Apptainer or podman, stood in for by
tests/stub_site.py (its commands record their arguments and keep Slurm's, pyxis' and Ray's
semantics): the start-up's order, every step in the node's named container with the Ray folder,
sick nodes excluded before a requeue, `scancel` for good, stops without progress bounded, the
bring-up ladder's rungs and NeMo-Run's job. The real Slurm runs of the same scripts are in
tests/test_multinode.py."""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import stub_site
from tests.slurm_jobs import ensure_packages

REPO = Path(__file__).resolve().parents[1]
IMAGE = "/images/nemo-dapo.sqsh"


class Site:
    def __init__(self, folder: Path, **config) -> None:
        self.folder = folder
        self.env = {**os.environ, **stub_site.install(folder / "site", **config)}
        for name in ("data", "ckpt", "logs", "models/Qwen2.5-32B", "models/Qwen2.5-7B"):
            (folder / name).mkdir(parents=True, exist_ok=True)
        with socket.socket() as probe:  # a free port for this site's Ray head
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.env |= {"DATA_DIR": str(folder / "data"), "CKPT_DIR": str(folder / "ckpt"),
                     "LOG_DIR": str(folder / "logs"), "HF_MODEL": str(folder / "models" / "Qwen2.5-32B"),
                     "CONTAINER": IMAGE, "RAY_PORT": str(port), "FABRIC_IFNAME": "lo",
                     "STUB_TRAINER": "train:2,exit:0"}  # fmt: skip
        self.output = folder / "job.out"

    def submit(
        self, *overrides: str, script: str = "slurm/dapo_32b.sbatch", nodes: int = 16, cwd: Path = REPO, **env: str
    ) -> str:
        done = subprocess.run(
            ["sbatch", "--parsable", f"--output={self.output}", f"--nodes={nodes}", script, *overrides],
            env=self.env | env, capture_output=True, text=True, cwd=cwd, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def job(self, job: str) -> dict[str, str]:
        said = subprocess.run(["scontrol", "show", "job", job], env=self.env, capture_output=True, text=True).stdout
        return dict(re.findall(r"(\w+)=(\S+)", said))

    def wait_end(self, job: str, timeout: float = 120) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while self.job(job)["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED"):
            assert time.monotonic() < deadline, self.log()[-3000:]
            time.sleep(0.3)
        return self.job(job)

    def wait_for(self, kind: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while not self.calls(kind):
            assert time.monotonic() < deadline, f"no {kind} call\n{self.log()[-3000:]}"
            time.sleep(0.2)
        return self.calls(kind)[-1]

    def calls(self, kind: str | None = None) -> list[dict]:
        return stub_site.calls(self.folder / "site", kind)

    def steps(self) -> list[dict]:
        return self.calls("srun")

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else ""


@pytest.fixture
def site(tmp_path):
    ensure_packages("shellcheck")  # the Debian tools the scripts use (getent, awk) come with the base system
    return Site(tmp_path)


def command_of(step: dict) -> str:
    return " ".join(step["command"])


def pyxis_flags(step: dict) -> dict[str, str]:
    return dict(re.findall(r"^--(container-[a-z]+)=(.*)$", "\n".join(step["options"]), re.M))


# ----------------------------------------------------------------------------- start-up in order
def test_a_16_node_pyxis_job_starts_in_order_and_every_step_joins_its_nodes_container(site):
    """Preflight on every node outside any container, then every node's named container in one
    step, the head, the workers once the head answers (its start held 2 s here), one readiness
    step with $PYTHON, the trainer on the head node with its CPUs; every container step binds the
    node's Ray folder; the containers go when the job ends for good."""
    job = site.submit("trainer.total_training_steps=2", RAY_HEAD_START_DELAY_S="2")
    assert site.wait_end(job)["JobState"] == "COMPLETED", site.log()[-3000:]
    steps = site.steps()
    kinds = [re.sub(r".*ray_node.sh ", "", command_of(s)).split()[0] if "ray_node.sh" in command_of(s) else
             "ready" if "ray_ready.py" in command_of(s) else "train" if "nemo_dapo.cli train" in command_of(s) else
             "cleanup" for s in steps]  # fmt: skip
    assert kinds == ["preflight", "container", "ray", "ray", "ready", "train", "cleanup"], kinds
    preflight, containers, head, workers, ready, train, cleanup = steps
    everyone = [f"node{i:02d}" for i in range(1, 17)]
    assert preflight["nodes"] == containers["nodes"] == cleanup["nodes"] == everyone
    assert not pyxis_flags(preflight) and not pyxis_flags(cleanup)  # on the node itself
    unpacked = [c["node"] for c in site.calls("pyxis-unpack")]
    assert sorted(unpacked) == everyone and not site.calls("pyxis-race")  # once per node, before any other step
    ray_folder = f"/tmp/ray_{job}"
    for step in (containers, head, workers, ready, train):
        flags = pyxis_flags(step)
        assert flags["container-name"] == f"nemo-dapo-{job}" and flags["container-image"] == IMAGE, step
        assert f"{ray_folder}:{ray_folder}" in flags["container-mounts"].split(","), step
    # the workers only once the head answered; the wait is the head's, not Ray's worker timeout
    started = {c["node"]: c["time"] for c in site.calls("ray")}
    assert min(t for n, t in started.items() if n != "node01") >= started["node01"]
    assert workers["time"] - head["time"] >= 2 and "--kill-on-bad-exit=1" in workers["options"]
    assert ready["command"][0] == site.env["PYTHON"] and ready["nodes"] == ["node01"]
    assert train["nodes"] == ["node01"] and "--cpus-per-task=32" in train["options"]
    (trainer,) = site.calls("train")
    assert trainer["sees_ray"] and trainer["env"]["PYTHONPATH"] == str(REPO)  # the image's own, not the host's
    assert trainer["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] is None  # the Megatron ranks set it, not the job
    assert trainer["env"]["HF_HOME"].startswith("/tmp/nemo-dapo-cache-")
    assert not list((site.folder / "site" / "nodes").rglob("pyxis_*"))  # removed at the final exit
    assert "dapo: TERM_TIMEOUT=25 s (Slurm's KillWait is 30 s)" in site.log()  # requeued before SIGKILL


def test_a_two_pool_heterogeneous_job_starts_each_component_in_its_own_steps(site):
    """slurm/dapo_pools.sbatch (12 training + 4 rollout nodes): every step on the rollout nodes names
    their component (Slurm refuses it otherwise), each component gets its named containers, every
    node's Ray offers its pool, each rollout node's Ray is a step of its own that one node's end
    does not take down, and the trainer is given both pools from the allocation."""
    job = site.submit("trainer.total_training_steps=2", script="slurm/dapo_pools.sbatch", nodes=12)
    assert site.wait_end(job)["JobState"] == "COMPLETED", site.log()[-3000:]
    training, rollout = [f"node{i:02d}" for i in range(1, 13)], [f"node{i:02d}" for i in range(13, 17)]
    for step in site.steps():
        group = "--het-group=1" if set(step["nodes"]) <= set(rollout) else "--het-group=0"
        assert group in step["options"], step
    containers = [s for s in site.steps() if command_of(s).endswith("ray_node.sh container")]
    assert sorted(n for s in containers for n in s["nodes"]) == training + rollout and not site.calls("pyxis-race")
    assert all(pyxis_flags(s)["container-name"] == f"nemo-dapo-{job}" for s in containers)
    pools = {c["node"]: re.search(r"nemo_dapo_pool_(\w+)", " ".join(c["argv"])).group(1) for c in site.calls("ray")}
    assert pools == dict.fromkeys(training, "train") | dict.fromkeys(rollout, "rollout"), pools
    rays = [s for s in site.steps() if "ray_node.sh ray worker" in command_of(s)]
    assert sorted(len(s["nodes"]) for s in rays) == [1, 1, 1, 1, 11]  # each rollout node alone
    assert all("--kill-on-bad-exit=1" not in s["options"] for s in rays if len(s["nodes"]) == 1)
    (ready,) = [s for s in site.steps() if "ray_ready.py" in command_of(s)]
    assert ready["command"][2:5] == [ready["command"][2], "16", "128"]  # every node and GPU of both pools
    (trainer,) = site.calls("train")
    for override in ("trainer.nnodes=12", "trainer.rollout_pool.nnodes=4", "trainer.rollout_pool.n_gpus_per_node=8",
                     "actor.num_workers=96", "trainer.colocate=false"):  # fmt: skip
        assert override in trainer["argv"], trainer["argv"]
    assert any(a.startswith("checkpoint.save_by=") for a in trainer["argv"])  # squeue's line per component read


def test_ray_cluster_sh_as_a_command_ends_its_ray_steps_with_the_command(site):
    """`slurm/ray_cluster.sh CMD` in an allocation (salloc): when CMD ends, the Ray steps end too
    (their srun is what is signalled, not a shell around it)."""
    import psutil

    env = site.env | {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node01,node02", "SLURM_CPUS_ON_NODE": "4",
                      "CONTAINER": ""}  # fmt: skip
    done = subprocess.run(["bash", "slurm/ray_cluster.sh", "true"], env=env, capture_output=True, text=True, cwd=REPO,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0 and "ray_cluster: ready" in done.stdout, done.stderr
    ray = str(site.folder / "site" / "bin" / "ray")
    deadline = time.monotonic() + 5
    while left := [p for p in psutil.process_iter(["cmdline"]) if ray in " ".join(p.info["cmdline"] or [])]:
        assert time.monotonic() < deadline, left
        time.sleep(0.2)


@pytest.mark.parametrize("runtime", ["apptainer", "podman"])
def test_every_runtime_gives_each_step_the_ray_folder(site, runtime):
    """Apptainer binds, podman volumes: the readiness check and the trainer reach the head's
    folder; the preflight stays outside any container. (The nodes' own Python, CONTAINER=none,
    is the namespace cluster's, tests/test_multinode.py.) Submitted from outside the checkout, by
    the script's path: the job finds its checkout."""
    script = str(REPO / "slurm" / "dapo_32b.sbatch")
    job = site.submit("trainer.total_training_steps=2", script=script, nodes=2, cwd=site.folder,
                      CONTAINER_RUNTIME=runtime)  # fmt: skip
    assert site.wait_end(job)["JobState"] == "COMPLETED", site.log()[-3000:]
    (trainer,) = site.calls("train")
    assert trainer["sees_ray"] and trainer["env"]["STUB_CONTAINER"] == runtime
    wrapped = [s for s in site.steps() if s["command"][0] in ("apptainer", "podman")]
    assert len(wrapped) == 4  # head, workers, readiness, trainer
    for step in wrapped:
        assert f"/tmp/ray_{job}:/tmp/ray_{job}" in " ".join(step["command"]), step
    assert "ray_node.sh preflight" in command_of(site.steps()[0]) and site.steps()[0]["command"][0] == "bash"


# ----------------------------------------------------------------------------- failures that requeue
def test_sick_nodes_are_named_excluded_and_the_job_requeues_without_them(site):
    """Nodes on an old driver or short of a GPU (their preflight), a node whose Ray cannot start
    (its worker's retries): each start-up fails naming its nodes, goes through the requeue policy
    as a crash without progress, and the requeued job excludes them; the third run trains."""
    stub_site.install(site.folder / "site", drivers={"node02": "570.86.10"}, lost_gpus={"node04": 7},
                      ray_fails=["node03"])  # fmt: skip
    job = site.submit("trainer.total_training_steps=2", nodes=4, RAY_START_RETRIES="2")
    state = site.wait_end(job, timeout=180)
    log = site.log()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "2", log[-4000:]
    assert "node02: NVIDIA driver 570.86.10: the image's CUDA 13 needs R580 or newer" in log
    assert "node04: nvidia-smi lists 7 GPUs, the job needs 8" in log
    assert "node03: ray start failed 2 times" in log
    assert "requeue: node(s) node02,node04 excluded from the requeued job (ExcNodeList=node02,node04)" in log
    assert "requeue: node(s) node03 excluded from the requeued job (ExcNodeList=node02,node03,node04)" in log
    assert len(site.calls("train")) == 1
    # the named containers stay on the nodes across the requeues, and go at the final exit only
    assert len([s for s in site.steps() if "enroot remove" in command_of(s)]) == 1
    preflights = [s["nodes"] for s in site.steps() if "preflight" in command_of(s)]
    assert preflights[-1] == ["node01", "node05", "node06", "node07"]
    assert (site.folder / "logs" / job / "crash_requeues").read_text().split() == ["2", "0"]


def test_scancel_stops_the_job_for_good_and_a_term_to_its_processes_requeues_it(site):
    """`scancel` (JobState COMPLETING, no reason) ends the job without a requeue; a TERM to every
    process while it runs (preemption's grace time, `scancel --full --signal=TERM`) requeues it."""
    site.env["STUB_TRAINER"] = "train:1,save:1,stop;train:1,exit:0"
    first = site.submit(nodes=2)
    site.wait_for("train")
    subprocess.run(["scancel", first], env=site.env, check=True)
    state = site.wait_end(first)
    assert state["JobState"] == "CANCELLED" and state["Restarts"] == "0", site.log()[-3000:]
    assert "requeue: the job was cancelled (scancel): not requeued" in site.log()
    assert not [c for c in site.calls("scontrol") if c["argv"][:1] == ["requeue"]]
    second = site.submit(nodes=2)
    deadline = time.monotonic() + 60
    while len(site.calls("train")) < 2:
        assert time.monotonic() < deadline, site.log()[-3000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--full", "--signal=TERM", second], env=site.env, check=True)
    state = site.wait_end(second)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", site.log()[-3000:]


def test_stops_before_a_first_step_requeue_a_bounded_number_of_times(site):
    """A run that stops before finishing a step (a USR1 while Ray starts; the trainer's exit 4)
    made no progress: counted like a crash, requeued MAX_CRASH_REQUEUES times, then the job stops
    naming why instead of requeueing forever (a time limit too short for the start-up would)."""
    site.env["STUB_TRAINER"] = "exit:4"
    job = site.submit(nodes=2, RAY_HEAD_START_DELAY_S="2", MAX_CRASH_REQUEUES="1")
    deadline = time.monotonic() + 30
    while "ray_cluster: head" not in site.log():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=site.env, check=True)  # while Ray starts
    state = site.wait_end(job, timeout=120)
    log = site.log()
    assert state["JobState"] == "FAILED" and state["Restarts"] == "1", log[-3000:]
    assert log.count("dapo: stopped before finishing a step in this run: no progress") == 2
    assert "requeue: stopped before finishing a step in this run (exit 4: see the trainer's last lines): requeueing" \
        " (1 of 1 requeues without progress)" in log  # fmt: skip
    assert "after 1 requeue(s) without a new checkpoint (MAX_CRASH_REQUEUES=1): not requeued" in log
    assert len(site.calls("train")) == 1  # the first run stopped before its trainer started


# ----------------------------------------------------------------------------- the bring-up ladder
MODELS = {  # each preset's model folder, and its one-node sibling's
    "dapo_qwen2.5_32b": ("Qwen2.5-32B", "Qwen2.5-7B"),
    "dapo_qwen3_30b_a3b": ("Qwen3-30B-A3B-Base", "Qwen3-8B-Base"),
}


def ladder(site: Site, rung: int, preset: str, args: list[str] = (), **env: str) -> subprocess.CompletedProcess:
    """``slurm/bringup_ladder.sh RUNG`` for PRESET, its models in folders named as the site's."""
    folder, models = site.folder / f"bringup-{preset}", [site.folder / "models" / name for name in MODELS[preset]]
    for model in models:
        model.mkdir(parents=True, exist_ok=True)
    env = site.env | {"BRINGUP_DIR": str(folder), "CONFIG": preset, "POLL_S": "0.5", "STUB_TRAINER": "train:3,exit:0",
                      "HF_MODEL": str(models[0]), "SMALL_HF_MODEL": str(models[1])} | env  # fmt: skip
    return subprocess.run(["bash", "slurm/bringup_ladder.sh", str(rung), *args], env=env, capture_output=True,
                          text=True, cwd=REPO, timeout=180)  # fmt: skip


def test_ladder_rungs_submit_jobs_whose_configs_pass_config_and_plan_and_one_that_cannot_fit_is_refused(site):
    """Rung 1 of the 32B preset (one node: its one-node sibling) and rung 2 of the 30B-A3B preset (two
    nodes: the preset, fitted) pass their checks, and the trainer's own arguments, as the batch script
    built them, load and fit (every rung of both presets: tests/test_plan.py). The first rung also
    meets a controller too busy to answer three times: the ladder asks again, the job is not taken
    for gone. A rung that cannot run on its nodes is refused before sbatch."""
    from nemo_dapo.commands.plan import make_plan
    from nemo_dapo.config import load_config
    from nemo_dapo.config.capacity import gpu_memory_gib

    done = ladder(site, 2, "dapo_qwen2.5_32b", NODES="1")
    assert done.returncode == 2 and "rung 2 (dapo_qwen2.5_32b on 1 node(s)) cannot run" in done.stderr, done.stderr
    assert "16 must divide the 8 training ranks" in done.stderr and not site.calls("sbatch")
    stub_site.install(site.folder / "site", scontrol_failures=3)  # slurmctld busy for three questions
    said = []
    for preset, rung, sibling in (("dapo_qwen2.5_32b", 1, "dapo_qwen2.5_7b"), ("dapo_qwen3_30b_a3b", 2, None)):
        done = ladder(site, rung, preset, args=["trainer.total_training_steps=3"])  # overrides after the rung
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        said.append(done.stdout + done.stderr)
        trainer = site.calls("train")[-1]
        config, overrides = trainer["argv"][1], trainer["argv"][2:]
        assert config == (sibling or preset) and "trainer.total_training_steps=3" == overrides[-1]
        assert int(re.search(r"trainer\.nnodes=(\d+)", " ".join(overrides)).group(1)) == (1 if rung == 1 else 2)
        os.environ["HF_MODEL"] = str(site.folder / "models" / MODELS[preset][rung == 1])
        try:
            cfg = load_config(config, overrides)
        finally:
            del os.environ["HF_MODEL"]
        plan = make_plan(cfg, config, gpu_memory_gib("H800"), 4.0, 2.0)
        assert not plan.problems and plan.headroom >= 2.0, (rung, plan.problems)
    assert said[0].count("bringup: scontrol failed") == 3 and "bringup: scontrol failed" not in said[1]
    assert "pass  fabric      NCCL uses NET/IB" in said[1]  # rung 2 requires it
    assert len(site.calls("sbatch")) == 2


# ----------------------------------------------------------------------------- NeMo-Run
def test_nemo_runs_job_joins_the_named_container_and_requeues_without_a_sick_node(site, tmp_path):
    """The batch script `nemo-dapo launch --executor slurm` writes, run on the site: its trainer step
    joins the node's named container with the Ray folder and the node's CPUs; a start-up that
    fails on a node goes through the requeue policy (counted per job) and excludes the node."""
    pytest.importorskip("nemo_run")
    home = tmp_path / "nemorun"
    launch = [sys.executable, "-m", "nemo_dapo.cli", "launch", "--config", "dapo_qwen2.5_32b", "--executor", "slurm",
              "--dryrun", "--nodes", "2", "--container-image", IMAGE, "--python", site.env["PYTHON"],
              "--data-dir", site.env["DATA_DIR"], "--hf-model", site.env["HF_MODEL"]]  # fmt: skip
    done = subprocess.run([*launch, "trainer.total_training_steps=2"], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "NEMORUN_HOME": str(home)}, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    script = done.stdout[done.stdout.index("#!/bin/bash") :]
    task_dir = Path(re.search(r"^cd (\S+)/code$", script, re.M).group(1))
    task_dir.mkdir(parents=True)
    (task_dir / "code").symlink_to(REPO)  # what NeMo-Run's packager puts there
    (tmp_path / "job.sbatch").write_text(script)
    stub_site.install(site.folder / "site", ray_fails=["node02"])
    site.env |= {"RAY_START_RETRIES": "1", "STUB_TRAINER": "train:2,exit:0"}
    job = site.submit(script=str(tmp_path / "job.sbatch"), nodes=2)
    state = site.wait_end(job, timeout=120)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", site.log()[-3000:]
    assert state["ExcNodeList"] == "node02"
    logs = Path(re.search(r"^export LOG_DIR=(\S+)$", script, re.M).group(1))
    assert (logs / job / "crash_requeues").read_text().split()[0] == "1"  # per job, not per experiment
    (trainer,) = site.calls("train")
    step = next(s for s in site.steps() if "nemo_dapo.cli" in command_of(s))
    assert trainer["sees_ray"] and trainer["env"]["STUB_CONTAINER_NAME"] == f"nemo-dapo-{job}"
    assert "--cpus-per-task=32" in step["options"] and f"/tmp/ray_{job}:/tmp/ray_{job}" in " ".join(step["options"])
    assert not site.calls("pyxis-race")
