"""Two pools on a Ray of several nodes on this machine: a lost rollout node costs engines, not the run.

A Ray cluster of real nodes on loopback (``ray.cluster_utils.Cluster``: a GCS and a raylet per
node, each node's processes its own): a training node (the head, the pool resource
``nemo_dapo_pool_train``) and two rollout nodes with room for one engine each
(``nemo_dapo_pool_rollout``, one CPU). ``nemo-dapo train`` attaches to it with
``trainer.rollout_pool.nnodes=2`` in the streaming mode (the sync mode's run is the
heterogeneous Slurm job's in ``tests/test_multinode.py``). One rollout node is killed mid-run (its
raylet and every worker of it SIGKILLed, Ray's own node failure): its engine's groups go to the
other, the run goes on with one engine and loses and repeats no prompt; a rollout node joins
again and the engine count is back at the next weight sync.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from nemo_dapo.cluster.placement import pool_resource
from tests.train_runs import CLI, ENV, SMALL, latest_state, records

pytestmark = pytest.mark.slow
HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}  # a dead node noticed in ~2 s


def rollout_node(cluster):
    return cluster.add_node(num_cpus=1, resources={pool_resource("rollout"): 1.0}, node_ip_address="127.0.0.1")


@pytest.fixture
def pools(monkeypatch):
    from ray.cluster_utils import Cluster

    folder = tempfile.mkdtemp(prefix="pools")  # mode 0700; short: Ray's socket paths must fit 107 bytes
    os.mkdir(f"{folder}/ray")
    monkeypatch.setenv("RAY_TMPDIR", folder)  # where Ray notes the cluster's address, not /tmp/ray
    # token authentication on, whatever an earlier local Ray of this process left set (Ray turns it
    # on for a local cluster by setting RAY_AUTH_MODE in the process): the run is told the same
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    head = {
        "num_cpus": 3,
        "resources": {pool_resource("train"): 1.0},
        "node_ip_address": "127.0.0.1",
        "temp_dir": f"{folder}/ray",
        "include_dashboard": False,
        "_system_config": HEALTH,
    }
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
    nodes = [rollout_node(cluster), rollout_node(cluster)]
    cluster.wait_for_nodes()
    yield cluster, nodes
    cluster.shutdown()
    shutil.rmtree(folder, ignore_errors=True)


def wait_until(what: str, condition, run: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert run.poll() is None, f"the run ended ({run.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        time.sleep(0.2)


def steps_done(output: Path) -> int:
    return len(engines_per_step(output))


def engines_per_step(output: Path) -> list[float]:
    """The engines in service after each finished step."""
    path = output / "metrics.jsonl"
    return [row["recovery/engines"] for row in records(path) if "actor/pg_loss" in row] if path.exists() else []


@pytest.mark.timeout(900)
def test_a_lost_rollout_node_costs_its_engine_and_the_engine_comes_back_with_the_node(pools, tmp_path):
    cluster, nodes = pools
    output, log = tmp_path / "run", tmp_path / "run.log"
    total = 40
    overrides = [
        f"trainer.output_dir={output}",
        "trainer.mode=stream",
        "trainer.rollout_pool.nnodes=2",
        "trainer.rollout_pool.n_gpus_per_node=0",
        "rollout.num_workers=2",
        "trainer.cpu_threads_per_worker=1",
        f"trainer.total_training_steps={total}",
        "trainer.save_freq=0",
        *SMALL,
    ]
    env = {**ENV, "RAY_ADDRESS": cluster.address, "RAY_AUTH_MODE": "token"}
    with open(log, "w") as out:
        run = subprocess.Popen([*CLI, "train", *overrides], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until("step 2", lambda: steps_done(output) >= 2, run)
        cluster.remove_node(nodes[1], allow_graceful=False)  # SIGKILL: the raylet and its workers
        wait_until("a step on one engine", lambda: 1 in engines_per_step(output), run)
        assert re.search(r"rollout engine \d: its node \S+ is lost .*; engines 2 -> 1", log.read_text())
        rollout_node(cluster)  # the node is back (another raylet offering the rollout pool)
        wait_until("the engine back", lambda: "engines 1 -> 2" in log.read_text(), run)
        assert run.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        run.kill()
    said = log.read_text()
    engines = engines_per_step(output)
    assert engines[0] == 2 and 1 in engines and engines[-1] == 2, engines
    restarts = [row["recovery/engine_restarts"] for row in records(output / "metrics.jsonl") if "actor/pg_loss" in row]
    assert not any(restarts)  # a lost node is no engine failure
    assert said.count("is back on node") == 1 and "fewer than rollout.min_engines" not in said
    prompts = records(output / "prompts.jsonl")
    assert [row["step"] for row in prompts] == list(range(1, total + 1))
    # every row drawn is trained, filtered, or still waiting at the end (the last checkpoint), none twice
    fates = Counter(row for r in prompts for row in r["trained"] + r["filtered"])
    untrained = Counter(latest_state(output)["stream_untrained"])
    assert fates + untrained == Counter(row for r in prompts for row in r["consumed"])
    assert re.search(r"rollout engine\(s\) \[\d\] lost while streaming: sending their \d+ groups to the others", said)
    assert json.loads((output / "summary.json").read_text())["steps"] == total
