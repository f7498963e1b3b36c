"""Two pools on the namespace cluster (docs/benchmarks.md, "Two pools"): a heterogeneous job's step
time and engine busy share with one and two rollout nodes for one training node, and what a lost
rollout node costs (the time from its death to the next finished step) against today's single-pool
job, which requeues and resumes for the same failure.

    .venv/bin/python bench/rollout_pools.py [--steps 30]

The nodes are network namespaces on this machine's 2 cores (tests/slurm/setup_netns_slurm.sh): a
second rollout node adds an engine, not compute, so the step times say what the layout costs here,
not how it scales on GPUs. The requeued job is released at once (`scontrol update StartTime=now`,
as the tests do) instead of Slurm's own hold of about two minutes, which a site adds on top.
Prints one JSON object. Needs root; not in CI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from control_plane import SETUP, cluster_env, setup

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.slurm_jobs import Job, submit  # noqa: E402 (the test suite's job helpers, on the repository root)
from tests.train_runs import SMALL, records  # noqa: E402

PREFIX = ("bash", str(SETUP), "exec", "ctl")
COMMON = ["trainer.placement_strategy=SPREAD", "trainer.cpu_threads_per_worker=1", "trainer.test_freq=0", *SMALL]
TWO_AND_TWO = ["actor.num_workers=2", "rollout.num_workers=2"]  # the pools come from the allocation
STEP_LINE = re.compile(r"^(\S+ \S+) nemo_dapo: step (\d+): ", re.M)


def run_job(env: dict, work: Path, name: str, overrides: list[str], sbatch_args: list[str], **extra: str) -> Job:
    folder = work / name
    folder.mkdir(parents=True)
    job_env = {**env, "CKPT_DIR": str(folder / "ckpt"), "LOG_DIR": str(folder / "logs"), **extra}
    return submit(job_env, folder / "job.out", "slurm/dapo_tiny_cpu.sbatch", overrides, sbatch_args, PREFIX)


def wait(job: Job, condition, what: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"job {job.id}: no {what} after {timeout:.0f} s\n{job.log()[-3000:]}")
        time.sleep(0.5)


def finished(job: Job) -> bool:
    return job.field("JobState") in ("COMPLETED", "FAILED", "CANCELLED")


def step_times(job: Job) -> list[tuple[float, int]]:
    """(Unix time, step) of every step line the job printed."""
    return [(datetime.datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(s)) for t, s in
            STEP_LINE.findall(job.log()) if int(s) > 0]  # fmt: skip


def steady(out: Path, skip: int) -> dict:
    """Mean step time and engine busy share over the steps after the first ``skip``."""
    rows = [r for r in records(out / "metrics.jsonl") if "actor/pg_loss" in r][skip:]
    return {
        "steps": len(rows),
        "step_s": round(sum(r["perf/time_per_step"] for r in rows) / len(rows), 3),
        "engine_busy": round(sum(r["stream/engine_busy"] for r in rows) / len(rows), 3),
    }


def throughput(env: dict, work: Path, rollout_nodes: int, steps: int) -> dict:
    """One training node (n1), ``rollout_nodes`` rollout nodes, the stream trainer."""
    overrides = [*COMMON, f"trainer.total_training_steps={steps}", "trainer.save_freq=0", "trainer.mode=stream",
                 f"rollout.num_workers={rollout_nodes}"]  # fmt: skip
    components = ["--no-kill", "-p", "train", "-N", "1", ":", "--no-kill", "-p", "rollout", "-N", str(rollout_nodes)]
    job = run_job(env, work, f"pools_{rollout_nodes}", overrides, components, RAY_ROLLOUT_CPUS_PER_NODE="1")
    wait(job, lambda: finished(job), "end")
    return steady(work / f"pools_{rollout_nodes}" / "ckpt", skip=5)


def lost_rollout_node(env: dict, work: Path, steps: int) -> dict:
    """Two training nodes (a heterogeneous job's training component of one node is requeued
    whole when a rollout node fails: docs/cluster.md, "Two pools"), two rollout nodes, n4 killed
    after step 5: seconds from the kill to the next finished step."""
    overrides = [*COMMON, f"trainer.total_training_steps={steps}", "trainer.save_freq=0", *TWO_AND_TWO]
    components = ["--no-kill", "-p", "train", "-N", "2", ":", "--no-kill", "-p", "rollout", "-N", "2"]
    job = run_job(env, work, "degraded", overrides, components, RAY_ROLLOUT_CPUS_PER_NODE="1")
    wait(job, lambda: len(step_times(job)) >= 5, "step 5")
    killed = time.time()
    setup(env, "kill-node", "n4")
    mark_down(env, "n4")
    wait(job, lambda: finished(job), "end")
    setup(env, "start-node", "n4")
    after = [t for t, _ in step_times(job) if t > killed]
    return {"next_step_s": round(after[0] - killed, 1), "state": job.field("JobState"),
            "restarts": int(job.field("Restarts"))}  # fmt: skip


def requeued(env: dict, work: Path, steps: int) -> dict:
    """Today's single-pool job on two nodes (a rank and an engine on each), the second killed
    after step 5: the job requeues and resumes from its checkpoint of every step on the second node
    left; seconds from the kill to the next finished step."""
    overrides = [*COMMON, f"trainer.total_training_steps={steps}", "trainer.save_freq=1", *TWO_AND_TWO]
    job = run_job(env, work, "requeue", overrides, ["-p", "nodes", "-N", "2"])
    wait(job, lambda: len(step_times(job)) >= 5, "step 5")
    second = subprocess.run([*PREFIX, "scontrol", "show", "hostnames", job.field("NodeList")], env=env,
                            capture_output=True, text=True, check=True).stdout.split()[1]  # fmt: skip
    killed = time.time()
    setup(env, "kill-node", second)
    wait(job, lambda: job.field("Restarts") == "1", "requeue")
    mark_down(env, second)
    restarts = 0
    while not any(t > killed for t, _ in step_times(job)[5:]):  # every requeue released at once
        if int(job.field("Restarts")) > restarts:
            restarts = int(job.field("Restarts"))
            job.release_requeued(restarts)
        time.sleep(0.5)
    after = [t for t, _ in step_times(job) if t > killed]
    subprocess.run([*PREFIX, "scancel", job.id], env=env, check=True)
    setup(env, "start-node", second)
    return {"next_step_s": round(after[0] - killed, 1), "restarts": restarts}


def mark_down(env: dict, node: str) -> None:
    """As a site's node health check would, instead of waiting out SlurmdTimeout."""
    subprocess.run([*PREFIX, "scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=bench"], env=env,
                   check=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", choices=("requeue",), help="run the single-pool requeue alone")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/rollout_pools.py: network namespaces and slurmd need root")
    work = Path(tempfile.mkdtemp(prefix="rollout_pools_", dir="/tmp"))
    env = cluster_env(4, work) | {"NETNS_PARTITIONS": "nodes=n1,n2,n3 train=n1,n2 rollout=n3,n4"}
    if str(REPO).startswith("/tmp/"):  # the checkout (and its .venv) must be seen by every node
        env["NETNS_SHARED_PATHS"] += f":{REPO}"
    subprocess.run(["bash", str(SETUP), "stop"], capture_output=True, env=env, timeout=300)
    try:
        setup(env, "start")
        if args.only == "requeue":
            print(json.dumps({"single_pool_requeue": requeued(env, work, 4 * args.steps)}, indent=2))
            return
        result = {
            "one_rollout_node": throughput(env, work, 1, args.steps),
            "two_rollout_nodes": throughput(env, work, 2, args.steps),
            "rollout_node_lost": lost_rollout_node(env, work, 4 * args.steps),
            "single_pool_requeue": requeued(env, work, 4 * args.steps),
        }
        print(json.dumps(result, indent=2))
    finally:
        subprocess.run(["bash", str(SETUP), "stop"], capture_output=True, env=env, timeout=300)


if __name__ == "__main__":
    main()
