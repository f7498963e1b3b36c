"""The control plane at 2 to 16 nodes, simulated on this machine: how Ray's start-up, the ranks'
rendezvous, one step's stages and the bytes each rank receives grow with the node count, and
how long a node's death takes to detect, requeue and resume from.

    .venv/bin/python bench/control_plane.py --nodes 2 8 16 [--steps 6]

For each count N: the namespace Slurm cluster of tests/slurm/setup_netns_slurm.sh with N + 1
nodes (one spare for the requeue), and `slurm/dapo_tiny_cpu.sbatch --nodes=N` with one Megatron
rank of the tiny model per node (DP=N) and one vLLM engine (TP=1), weights over gloo. Times are
read off the job's output as it appears (polled every 0.2 s, from sbatch): Ray ready on every
node, the actor's ranks placed and met (the worker group's start: processes, rendezvous, the
model), the first step, then after the step-4 checkpoint the last allocated node SIGKILLed (every
process of its namespace): the run's error naming it, Slurm's requeue (the node then marked down,
as a health check would, and the job released), the resume and the next step. Per-step stage
times and bytes per rank per call come from the run's metrics.jsonl. Needs root; not in CI.
Prints one JSON line per node count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.slurm_jobs import submit  # noqa: E402 (the test suite's job helpers, on the repository root)

SETUP = REPO / "tests" / "slurm" / "setup_netns_slurm.sh"
POLL_S = 0.2
STAGES = ("gen", "old_log_prob", "adv", "update_actor", "sync_weights")


def cluster_env(nodes: int, work: Path) -> dict:
    from nemo_dapo.cluster.ray_env import LOOPBACK_ENV, WORKER_ENV

    base = {k: v for k, v in os.environ.items() if k not in LOOPBACK_ENV or k in WORKER_ENV}
    return {
        **base,
        "NETNS_NODES": str(nodes),
        "NETNS_SHARED_PATHS": str(work),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHON": sys.executable,
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }


def setup(env: dict, *command: str) -> str:
    done = subprocess.run(["bash", str(SETUP), *command], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{command}: {done.stderr[-2000:]}")
    return done.stdout


class Timeline:
    """When each pattern first appeared in the job's output (seconds since submission)."""

    def __init__(self, job, started: float) -> None:
        self.job, self.started, self.seen = job, started, {}

    def wait(self, name: str, pattern: str, after: int = 0, timeout: float = 1800) -> float:
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.job.log()[after:])
            if found:
                self.seen[name] = round(time.monotonic() - self.started, 1)
                return self.seen[name]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {name} ({pattern}) after {timeout:.0f} s\n{self.job.log()[-3000:]}")
            time.sleep(POLL_S)

    def mark(self, name: str) -> None:
        self.seen[name] = round(time.monotonic() - self.started, 1)


def overrides(nodes: int, steps: int) -> list[str]:
    return [
        "trainer.placement_strategy=SPREAD",
        "actor.backend=megatron",
        f"actor.num_workers={nodes}",
        "rollout.num_workers=1",
        "rollout.tensor_parallel_size=1",
        "trainer.cpu_threads_per_worker=1",
        "trainer.test_freq=0",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=4",
        "algorithm.filter_groups.enable=false",
        f"data.train_batch_size={nodes}",
        f"data.gen_batch_size={nodes}",
        f"actor.ppo_mini_batch_size={nodes}",
        "data.val_files=[]",
    ]


def run_one(nodes: int, steps: int, work: Path) -> dict:
    env = cluster_env(nodes + 1, work)
    subprocess.run(["bash", str(SETUP), "stop"], capture_output=True, env=env, timeout=300)
    booted = time.monotonic()
    setup(env, "start")
    result: dict = {"nodes": nodes, "cluster_boot_s": round(time.monotonic() - booted, 1)}
    folder = work / f"n{nodes}"
    folder.mkdir()
    prefix = ("bash", str(SETUP), "exec", "ctl")
    job_env = {**env, "CKPT_DIR": str(folder / "ckpt"), "LOG_DIR": str(folder / "logs")}
    started = time.monotonic()
    job = submit(job_env, folder / "job.out", "slurm/dapo_tiny_cpu.sbatch", overrides(nodes, steps),
                 sbatch_args=[f"--nodes={nodes}"], prefix=prefix)  # fmt: skip
    line = Timeline(job, started)
    try:
        line.wait("ray_ready", r"ray_cluster: ready at")
        line.wait("actor_ranks_up", rf"actor: {nodes} worker\(s\) on {nodes} node\(s\)")
        line.wait("first_step", r"nemo_dapo\S*: step 1: ")
        line.wait("checkpoint_4", r"saved checkpoint \S+/global_step_4")
        allocated = job.field("NodeList")
        victim = expand(allocated)[-1]
        before = len(job.log())
        setup(env, "kill-node", victim)
        line.mark("node_killed")
        failed = r"worker died|RemoteCallError|Connection (reset|closed)|training failed"
        line.wait("error_reported", failed, after=before)
        job.wait_for("requeue", lambda: job.field("Restarts") == "1", timeout=600)
        line.mark("requeued")
        job.run("scontrol", "update", f"NodeName={victim}", "State=DOWN", "Reason=killed by the bench")
        job.release_requeued(1)
        line.mark("released")
        line.wait("resumed", r"resumed from \S+/global_step_4", after=before)
        line.wait("step_after_resume", r"nemo_dapo\S*: step 5: ", after=before)
        job.wait_for("completion", lambda: job.field("JobState") == "COMPLETED", timeout=1800)
    finally:
        subprocess.run([*prefix, "scancel", job.id], capture_output=True, env=env, timeout=60)
    result["seconds_since_submit"] = line.seen
    result |= step_numbers(folder / "ckpt" / "metrics.jsonl")
    return result


def expand(nodelist: str) -> list[str]:
    """n[1-3,5] -> [n1, n2, n3, n5] (Slurm's compact host list, one prefix)."""
    found = re.fullmatch(r"(\D+)\[(.*)\]", nodelist)
    if not found:
        return nodelist.split(",")
    names = []
    for part in found.group(2).split(","):
        low, _, high = part.partition("-")
        names += [f"{found.group(1)}{i}" for i in range(int(low), int(high or low) + 1)]
    return names


def step_numbers(metrics: Path) -> dict:
    """Median stage seconds over the steps before the kill (the first excluded: warm-up), and the
    bytes each rank received per call."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steady = [r for r in rows if 2 <= r.get("step", 0) <= 4 and "perf/time_per_step" in r]

    def median(key: str) -> float:
        values = sorted(r.get(key, 0.0) for r in steady)
        return round(values[len(values) // 2], 3) if values else float("nan")

    numbers = {f"timing_s/{s}": median(f"timing_s/{s}") for s in STAGES}
    numbers["perf/time_per_step"] = median("perf/time_per_step")
    numbers |= {k: median(k) for k in sorted({k for r in steady for k in r if k.startswith("perf/rank_input_mb")})}
    return {"step": numbers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/control_plane.py: network namespaces and slurmd need root")
    work = Path(tempfile.mkdtemp(prefix="control_plane_", dir="/tmp"))
    try:
        for nodes in args.nodes:
            try:
                print(json.dumps(run_one(nodes, args.steps, work)), flush=True)
            except (RuntimeError, TimeoutError, AssertionError) as error:
                print(json.dumps({"nodes": nodes, "failed": str(error)[-1500:]}), flush=True)
    finally:
        subprocess.run(["bash", str(SETUP), "stop"], capture_output=True, timeout=300)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
