"""The production shape on one machine: a Slurm cluster whose nodes are network namespaces.

``tests/slurm/setup_netns_slurm.sh`` makes four nodes (n1..n4: their own address on a private
bridge, hostname, /tmp and /dev/shm; the repository and the test's folders shared as a cluster
filesystem; n1..n3 the default partition, n1-n2 `train` and n3-n4 `rollout`) and a controller
(ctl), with a real slurmctld, one slurmd per node and munge. Jobs of
``slurm/dapo_tiny_cpu.sbatch --nodes=2`` then run as on a cluster: Ray's head on the first node, a
worker raylet on the second, token authentication on, Megatron ranks on both nodes (gloo over
their addresses), a vLLM engine with tensor_parallel_size=2, weight syncs across nodes. A node
dies (every process of its namespace SIGKILLed) and the run survives; Slurm requeues a job whose
node is gone; every process of a job gets SIGTERM (grace-time preemption); a heterogeneous job of
two pools loses rollout nodes and trains on without a requeue; NeMo-Run submits through its local
tunnel. Each job's steps are checked against an uninterrupted run's prompts.
"""

import contextlib
import datetime
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_dapo.cluster.ray_env import LOOPBACK_ENV, WORKER_ENV
from tests.slurm_jobs import REPO, Job, ensure_packages, newest_checkpoint, resumed_step, submit
from tests.train_runs import SMALL, expected_rounds, last_per_step, records

pytestmark = pytest.mark.slow
SETUP = REPO / "tests" / "slurm" / "setup_netns_slurm.sh"
STATE = Path(os.environ.get("NETNS_SLURM_DIR", "/var/tmp/nemo-dapo-netns"))
NODES = {"n1": "10.77.0.2", "n2": "10.77.0.3", "n3": "10.77.0.4", "n4": "10.77.0.5"}
FABRIC = {"n1": "10.78.0.2", "n2": "10.78.0.3", "n3": "10.78.0.4", "n4": "10.78.0.5"}  # each node's ib0
# the default partition (the single-pool jobs) has n1..n3; a heterogeneous job trains on n1, n2 and
# generates on n3, n4
PARTITIONS = "nodes=n1,n2,n3 train=n1,n2 rollout=n3,n4"
CLI = [sys.executable, "-m", "nemo_dapo.cli"]
# the tiny preset, Megatron at DP=2 one rank per node, a TP=2 engine; no validation in between
TWO_NODES = [
    "trainer.placement_strategy=SPREAD",
    "actor.backend=megatron",
    "actor.num_workers=2",
    "rollout.tensor_parallel_size=2",
    "trainer.cpu_threads_per_worker=1",
    "trainer.test_freq=0",
]
# two pools: torch ranks at DP=2 on the training pool (Megatron's, which also passed, cost the suite
# ~100 s more: docs/testing.md), an engine on each rollout node
POOLS = [
    "trainer.placement_strategy=SPREAD",
    "actor.num_workers=2",
    "rollout.num_workers=2",
    "trainer.rollout_pool.nnodes=2",
    "trainer.rollout_pool.n_gpus_per_node=0",
    "trainer.cpu_threads_per_worker=1",
    "trainer.test_freq=0",
]
POOL_COMPONENTS = ["--no-kill", "--partition=train", "--nodes=2", ":", "--no-kill", "--partition=rollout", "--nodes=2"]


class Cluster:
    """The namespace cluster: client commands run on its controller node, ctl."""

    def __init__(self, work: Path, env: dict) -> None:
        self.work, self.env = work, env
        self.prefix = ("bash", str(SETUP), "exec", "ctl")

    def on(self, node: str, *command: str, check: bool = True, timeout: float = 120) -> str:
        done = self.completed_on(node, *command, timeout=timeout)
        assert done.returncode == 0 or not check, f"{node}: {command}: {done.stderr[-2000:]}"
        return done.stdout

    def completed_on(self, node: str, *command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SETUP), "exec", node, *command],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=REPO,
            timeout=timeout,
        )

    def setup(self, *command: str) -> None:
        done = subprocess.run(["bash", str(SETUP), *command], capture_output=True, text=True, env=self.env, timeout=180)
        assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}{daemon_logs()}"

    def wait_idle(self, timeout: float = 120) -> None:
        """Until no node still completes an earlier job (whose nodes Slurm would not give the next)."""
        deadline = time.monotonic() + timeout
        while self.on("ctl", "sinfo", "--noheader", "--states=completing", "--format=%N").strip():
            assert time.monotonic() < deadline, self.on("ctl", "sinfo")
            time.sleep(1)

    def submit(self, name: str, overrides: list[str], nodes: int = 2, sbatch_args=(), **env: str) -> Job:
        folder = self.work / name
        folder.mkdir(parents=True, exist_ok=True)
        self.wait_idle()
        job_env = {**self.env, "CKPT_DIR": str(folder / "ckpt"), "LOG_DIR": str(folder / "logs"), **env}
        return submit(
            job_env,
            folder / "job.out",
            "slurm/dapo_tiny_cpu.sbatch",
            overrides,
            sbatch_args=[f"--nodes={nodes}", *sbatch_args],
            prefix=self.prefix,
        )

    def ladder(self, rung: int, name: str, overrides: list[str]) -> tuple[subprocess.Popen, Job]:
        """``slurm/bringup_ladder.sh RUNG`` with the tiny job, run on the controller node in the
        background; returns it and its job once submitted (the rung's folder is ``name/rung<N>``)."""
        folder = self.work / name
        env = {**self.env, "BRINGUP_DIR": str(folder), "LOG_DIR": str(folder / "logs"), "POLL_S": "1"}
        env |= {"BATCH_SCRIPT": "slurm/dapo_tiny_cpu.sbatch", "CONFIG": "tiny_cpu", "PYTHON": sys.executable}
        command = [*self.prefix, "bash", "slurm/bringup_ladder.sh", str(rung), *overrides]
        self.wait_idle()
        ladder = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
        )
        said = ""  # `nemo-dapo ladder`'s account of the rung comes first
        while not (submitted := re.search(r"^bringup: rung \d: job (\d+) on \d node\(s\), output (\S+)", said, re.M)):
            line = ladder.stdout.readline()
            assert line, said
            said += line
        return ladder, Job(self.env, Path(submitted.group(2)), submitted.group(1), self.prefix)

    def node_state(self, node: str) -> str:
        return self.on("ctl", "sinfo", "--noheader", f"--nodes={node}", "--format=%t").strip()

    def mark_down(self, node: str) -> None:
        """Tell Slurm a killed node is down, as a node health check does, until Slurm shows it so.
        A message its slurmd sent just before it died can reach slurmctld after the update and
        return the node to service (ReturnToService=2; seen once in a clean-clone run: "node_did_resp:
        node n3 returned to service" 8 ms after "state set to DOWN"); a health check marks it again
        on its next pass. A dead slurmd sends nothing more, so a second mark holds."""
        for _ in range(3):
            self.on("ctl", "scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=killed by the test")
            time.sleep(2)
            if "down" in self.node_state(node):
                return
        pytest.fail(f"{node} not down after 3 marks: {daemon_logs()}")


def daemon_logs() -> str:
    return "".join(f"\n--- {p}\n{p.read_text()[-1500:]}" for p in sorted((STATE / "log").glob("*.log")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("network namespaces and slurmd need root")
    ensure_packages("slurmctld", "slurmd", "munged", "sbatch")
    work = tmp_path_factory.mktemp("multinode")
    shared = ":".join(str(p) for p in (REPO, work) if str(p).startswith("/tmp/"))
    # what a job inherits: the interpreter on PATH, nothing of this process's loopback-only network setup
    base = {k: v for k, v in os.environ.items() if k not in LOOPBACK_ENV or k in WORKER_ENV}
    env = {
        **base,
        "NETNS_NODES": str(len(NODES)),
        "NETNS_PARTITIONS": PARTITIONS,
        "NETNS_SHARED_PATHS": shared,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHON": sys.executable,
        # a lost node is noticed by Ray within seconds (its default waits ~30 s)
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }
    state = Cluster(work, env)
    subprocess.run(["bash", str(SETUP), "stop"], capture_output=True, timeout=120)  # leftovers of a killed run
    state.setup("start")
    yield state
    subprocess.run(["bash", str(SETUP), "stop"], capture_output=True, timeout=120)


def metric(path: Path, step: int, name: str) -> float:
    return next(row[name] for row in records(path) if row["step"] == step and name in row)


def wait_for_line(job: Job, pattern: str, timeout: float = 240) -> re.Match:
    job.wait_for(repr(pattern), lambda: re.search(pattern, job.log()), timeout=timeout)
    return re.search(pattern, job.log())


def listeners(cluster: Cluster, node: str) -> list[tuple[str, str]]:
    """(address, process) of every listening TCP socket on ``node``."""
    found = []
    for line in cluster.on(node, "ss", "-Hltnp").splitlines():
        fields = line.split()
        address = fields[3].rsplit(":", 1)[0].strip("[]")
        found.append((address, fields[-1] if len(fields) > 5 else "?"))
    return found


def own_addresses(cluster: Cluster, node: str) -> set[str]:
    return {line.split()[3].split("/")[0] for line in cluster.on(node, "ip", "-o", "addr").splitlines()}


def check_the_network_rule(cluster: Cluster, node: str) -> None:
    """Every listener on the node's own address or loopback (a wildcard listener is reachable only
    at the namespace's addresses: loopback, the node's address and its link-local one), and no
    route beyond the private subnet."""
    own = own_addresses(cluster, node)
    mine = {NODES[node], FABRIC[node]}
    assert {a for a in own if not ipaddress.ip_address(a).is_loopback and not a.startswith("fe80:")} == mine
    routes = sorted(cluster.on(node, "ip", "-o", "route").splitlines())
    assert routes == [
        f"10.77.0.0/24 dev eth0 proto kernel scope link src {NODES[node]} ",
        f"10.78.0.0/24 dev ib0 proto kernel scope link src {FABRIC[node]} ",
    ], routes
    wildcard = {"0.0.0.0", "*", "::"}
    for address, who in listeners(cluster, node):
        plain = address.removeprefix("::ffff:")
        assert plain in wildcard or plain in mine or ipaddress.ip_address(plain).is_loopback, (address, who)


def connections(cluster: Cluster, node: str) -> list[tuple[str, str, str]]:
    """(local address, peer address:port, process) of every established TCP connection on ``node``."""
    found = []
    for line in cluster.on(node, "ss", "-Htnp", "state", "established").splitlines():
        fields = line.split()
        local, peer = fields[2].rsplit(":", 1)[0].strip("[]"), fields[3]
        found.append((local.removeprefix("::ffff:"), peer.removeprefix("[::ffff:").replace("]", ""), fields[-1]))
    return found


def check_the_fabric_carries_the_collectives(cluster: Cluster) -> None:
    """With FABRIC_IFNAME=ib0 the ranks' gloo pairs, the engine's TP ranks and their rendezvous
    connect n2 to n1 on the fabric; Ray's own traffic (its GCS at 6379) stays on the management
    network, where its object store (the batches, the weight buckets) also runs."""
    on_n2 = connections(cluster, "n2")
    fabric = [c for c in on_n2 if c[0] == FABRIC["n2"] and c[1].startswith(FABRIC["n1"] + ":")]
    assert len(fabric) >= 2 and all(any(p in who for p in ("ray::", "python", "VLLM::")) for *_, who in fabric), on_n2
    to_gcs = [c for c in on_n2 if c[1].endswith(":6379")]
    assert to_gcs and all(local == NODES["n2"] for local, _, _ in to_gcs), to_gcs


def check_ray_refuses_a_stranger(cluster: Cluster) -> None:
    """Ray across the nodes has token authentication: a client without the job's token is refused."""
    probe = (
        "import ray, sys\n"
        "try:\n"
        "    ray.init(address='10.77.0.2:6379', logging_level='ERROR', log_to_driver=False)\n"
        "except Exception as err:\n"
        "    print('refused:', type(err).__name__); sys.exit(0)\n"
        "print('admitted'); sys.exit(1)\n"
    )
    env = ["env", "RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN=" + "0" * 64, sys.executable, "-c", probe]
    done = cluster.completed_on("ctl", "timeout", "60", *env)
    # Ray's client keeps retrying a refused token (each retry logs InvalidAuthToken); on a loaded
    # machine it may still be retrying at the deadline: refused all the same, never admitted
    retrying = done.returncode == 124 and "InvalidAuthToken" in done.stderr
    assert "admitted" not in done.stdout and ("refused" in done.stdout or retrying), done.stderr[-2000:]


@pytest.mark.timeout(900)
def test_dapo_spans_two_nodes_learns_like_one_and_stops_before_its_time_limit(cluster, tmp_path):
    """Megatron DP=2 with one rank per node and a TP=2 engine: the first step's loss equals the same
    run's on one node, held-out accuracy rises, and the network rule holds on every node. Its first
    run has 4 minutes (checkpoint.save_by 120 s after its start, a minute before the time limit's
    USR1) and is held (its driver SIGSTOPped after step 2) until that time passed: it stops by the
    clock before its next step, checkpoints before the limit and requeues; given 30 minutes, the
    next run resumes from that step and redoes nothing."""
    steps, margin_s = 20, 120
    job = cluster.submit(
        "dp2",
        [*TWO_NODES, f"trainer.total_training_steps={steps}", "trainer.save_freq=0"],
        sbatch_args=["--time=4"],
        FABRIC_IFNAME="ib0",
        SAVE_MARGIN_S=str(margin_s),
    )
    try:
        placed = wait_for_line(job, r"actor: 2 worker\(s\) on 2 node\(s\)")
        assert set(re.findall(r"10\.77\.0\.\d", job.log()[placed.start() : placed.end() + 60])) == {
            NODES["n1"],
            NODES["n2"],
        }
        wait_for_line(job, r"nemo_dapo: step 2: ")
        assert "nemo_dapo: step 2: " in run_section(job.log(), 0), (  # else the clock stopped it first
            f"the first run stopped before step 2: its start-up took too long for its deadline\n{job.log()[-3000:]}"
        )
        driver = int((cluster.work / "dp2" / "logs" / job.id / "trainer.r0.pid").read_text())
        os.kill(driver, signal.SIGSTOP)  # held, whatever the machine's speed, until its deadline passed
        for node in ("n1", "n2"):
            check_the_network_rule(cluster, node)
        check_the_fabric_carries_the_collectives(cluster)
        check_ray_refuses_a_stranger(cluster)
        save_by = int(re.search(r"checkpoint\.save_by=(\d+)", job.log()).group(1))
        time.sleep(max(0.0, save_by + 1 - time.time()))
        os.kill(driver, signal.SIGCONT)
        job.wait_for("the stop by the clock", lambda: job.field("Restarts") == "1", timeout=240)
        job.run("scontrol", "update", f"JobId={job.id}", "TimeLimit=30")
        job.release_requeued(1, gone=lambda: not ray_leftovers(job, ["n1", "n2"]))
        job.wait_for("completion", lambda: job.field("JobState") == "COMPLETED", timeout=600)
    finally:
        job.run("scancel", job.id)
    log, out = job.log(), cluster.work / "dp2" / "ckpt"
    assert "dapo: TERM_TIMEOUT=5 s (Slurm's KillWait is 10 s)" in log  # requeued before SIGKILL
    stop = json.loads((out / "preemptions.jsonl").read_text().splitlines()[0])
    assert stop["signal"].startswith("checkpoint.save_by") and 1 <= stop["step"] < steps, stop
    assert "dapo: the trainer stopped before the job's end (checkpoint.save_by)" in run_section(log, 0)
    assert resumed_step(log, 1) == stop["step"]  # nothing redone
    # each run's deadline: Slurm's end of the job (4, then 30 minutes after its start) less SAVE_MARGIN_S
    first_by, last_by = (int(by) for by in re.findall(r"checkpoint\.save_by=(\d+)", log))  # two runs
    assert stop["time"] < first_by + margin_s, (stop, first_by)  # checkpointed before the time limit
    started = datetime.datetime.fromisoformat(job.field("StartTime")).timestamp()  # the last run's start
    assert abs(last_by - (started + 30 * 60 - margin_s)) <= 2, (job.field("StartTime"), last_by)
    # each node's Ray session logs, copied off its /tmp when its Ray stopped
    kept = cluster.work / "dp2" / "logs" / job.id / "nodes"
    assert (kept / "n1" / "r0" / "gcs_server.out").is_file() and (kept / "n2" / "r0" / "raylet.out").is_file()
    assert not (kept / "n2" / "r0" / "gcs_server.out").exists()  # n2's own logs, not the head's
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["final_val_acc"] > summary["initial_val_acc"] + 0.03, summary
    assert_first_step_as_on_one_node(out, tmp_path / "one_node")


def assert_first_step_as_on_one_node(out: Path, local: Path, layout: list[str] = TWO_NODES) -> None:
    """The multi-node layout's first step equals, bit for bit, the same layout's on one node (a local
    Ray on loopback, which offers both pools)."""
    done = subprocess.run(
        [*CLI, "train", f"trainer.output_dir={local}", *layout, "trainer.total_training_steps=1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm"):
        assert metric(out / "metrics.jsonl", 1, name) == metric(local / "metrics.jsonl", 1, name), name


def ray_processes(job: Job, nodes: list[str]) -> list[tuple[str, int, str]]:
    """(node, pid, command) of the processes of the job's Ray (its session folder /tmp/ray_<job id>
    in their arguments) alive on ``nodes`` (a node is a network namespace: its processes are that
    namespace's)."""
    found = []
    for node in nodes:
        pids = subprocess.run(["ip", "netns", "pids", f"nd-{node}"], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if f"/tmp/ray_{job.id}" in command:
                found.append((node, int(pid), command))
    return found


def ray_leftovers(job: Job, nodes: list[str]) -> list[str]:
    """The job's Ray processes still alive on ``nodes``, named."""
    return [f"{node}: {command[:120]}" for node, _, command in ray_processes(job, nodes)]


def kill_ray_on(job: Job, node: str) -> None:
    """SIGKILL every process of the job's Ray on ``node`` (raylet, engines, `ray start`), the node
    itself left up: its Ray died, as under the kernel's OOM killer."""
    for _, pid, _ in ray_processes(job, [node]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_section(log: str, restart: int) -> str:
    """What the batch script printed in one run of the job (restart 0, 1, ...)."""
    return log.split("dapo: restart ")[restart + 1]


def placed_on(log: str, restart: int) -> set[str]:
    """The nodes the actor's ranks ran on in that run."""
    found = re.search(r"actor: \d+ worker\(s\) on \d+ node\(s\): (.*)", run_section(log, restart))
    assert found, run_section(log, restart)[-3000:]
    return {name for name, address in NODES.items() if address in found.group(1)}


@pytest.mark.timeout(1500)
def test_a_job_survives_a_stop_signal_dead_nodes_an_outside_requeue_and_sigterm(cluster):
    """Megatron PP=2 with a stage per node. One job lives through: USR1 (checkpoint, exit 3,
    requeue); its second node SIGKILLed (a crash: requeued, resumed on the third node); the job
    requeued from outside and the node it moved to killed while it stops (not a crash); SIGTERM to
    every process (preemption with grace time: requeued before Ray is stopped, resumed from the
    newest periodic checkpoint). It completes with every step trained once, no prompt lost or repeated."""
    total = 24  # steps enough that each run still trains while the next incident is brought about
    overrides = [
        *TWO_NODES,
        "actor.num_workers=2",
        "actor.megatron.pipeline_model_parallel_size=2",
        "rollout.tensor_parallel_size=1",  # a TP=2 engine across nodes: the two-node test's
        f"trainer.total_training_steps={total}",
        "trainer.save_freq=2",
        "checkpoint.keep_last=3",
        *SMALL,
    ]
    # submitted by the bring-up ladder's stop drill, which sends the first incident's USR1
    ladder, job = cluster.ladder(4, "survivor", overrides)
    ckpt = cluster.work / "survivor" / "rung4"

    def after_new_checkpoint(restart: int) -> int:
        """Wait until this run resumed and saved a checkpoint of its own; return its step."""
        job.wait_for(f"resume #{restart}", lambda: len(re.findall("resumed from", job.log())) >= restart)
        resumed = resumed_step(job.log(), restart)
        job.wait_for("a new checkpoint", lambda: newest_checkpoint(ckpt) >= resumed + 2, timeout=240)
        assert job.field("JobState") == "RUNNING", "the run finished before the next incident"
        return resumed

    def release(restarts: int) -> None:
        job.release_requeued(restarts, gone=lambda: not ray_leftovers(job, list(NODES)))

    def node_lost(node: str, restarts: int) -> None:
        """Once the job is requeued, tell Slurm the node is down, as a cluster's node health check
        does (Slurm's own detection waits out SlurmdTimeout), and release the job: it must not be
        placed on the dead node."""
        job.wait_for(f"requeue #{restarts}", lambda: job.field("Restarts") == str(restarts))
        cluster.mark_down(node)
        release(restarts)

    try:
        # 1. USR1 to the batch shell (the time-limit warning), sent by the ladder after the first
        # checkpoint: checkpoint, exit 3, requeue
        job.wait_for("first checkpoint", lambda: newest_checkpoint(ckpt) >= 2, timeout=300)
        assert placed_on(job.log(), 0) == {"n1", "n2"}
        release(restarts=1)
        stop = json.loads((ckpt / "preemptions.jsonl").read_text().splitlines()[0])
        assert stop["signal"] == "SIGUSR1"
        # 2. the second node dies: the trainer fails (exit 1), the job requeues itself once
        after_new_checkpoint(1)
        cluster.setup("kill-node", "n2")
        node_lost("n2", restarts=2)
        job.wait_for("the run on n1 + n3", lambda: len(job.log().split("dapo: restart ")) > 3)
        cluster.setup("start-node", "n2")  # the node comes back, for the next incident
        # 3. the job is requeued from outside and the node it moved to dies while it stops: the
        # requeue comes first (the other order races the trainer's own crash exit, which the batch
        # script would count as a second crash: seen once in a clean-clone run)
        after_new_checkpoint(2)
        assert placed_on(job.log(), 2) == {"n1", "n3"}
        job.run("scontrol", "requeue", job.id)
        cluster.setup("kill-node", "n3")
        node_lost("n3", restarts=3)
        # 4. SIGTERM to every process of the job, batch shell and Ray included
        after_new_checkpoint(3)
        job.run("scancel", "--full", "--signal=TERM", job.id)
        release(restarts=4)
        job.wait_for("completion", lambda: job.field("JobState") == "COMPLETED", timeout=400)
        said = ladder.communicate(timeout=120)[0]
    finally:
        job.run("scancel", job.id)
        ladder.kill()
        cluster.setup("start-node", "n3")
    log = job.log()
    assert job.field("ExitCode") == "0:0" and job.field("Restarts") == "4"
    assert resumed_step(log, 1) == stop["step"]  # USR1: nothing redone
    assert "requeue: a crash (exit 1): requeueing (1 of 2 requeues without progress)" in run_section(log, 1)
    assert (cluster.work / "survivor" / "logs" / job.id / "crash_requeues").read_text().split()[0] == "1"
    terminated = run_section(log, 3)
    assert "SIGTERM received" in terminated
    # the requeue comes before Ray's teardown, which the requeue itself may cut short
    requeued = terminated.index("requeue: stopped by a signal or before the time limit (exit 3): requeueing")
    assert requeued < terminated.find("ray_cluster: stopping") or "ray_cluster: stopping" not in terminated
    # from the newest checkpoint committed before the stop (a save that SIGTERM cut short names
    # its step in its error, and is not resumed from)
    saved = [int(step) for step in re.findall(r"saved checkpoint \S+/global_step_(\d+)\n", terminated)]
    assert resumed_step(log, 4) == max(saved, default=resumed_step(log, 3)), terminated[-3000:]
    assert "skipping checkpoint" not in run_section(log, 4)
    by_step = last_per_step(records(ckpt / "prompts.jsonl"))
    assert sorted(by_step) == list(range(1, total + 1))
    consumed = [i for step in sorted(by_step) for i in by_step[step]["consumed"]]
    assert consumed == [i for r in expected_rounds(1800, 12, seed=1, count=len(consumed) // 12) for i in r]
    assert json.loads((ckpt / "summary.json").read_text())["steps"] == total
    # the ladder's verdict on its drill (docs/cluster.md): steps, checkpoint, and the USR1 stop in time
    assert ladder.returncode == 0 and f"USR1 sent to job {job.id} after its first checkpoint" in said, said
    for check in ("steps", "stages", "checkpoint"):
        assert re.search(rf"^pass  {check} ", said, re.M), said
    took = re.search(
        rf"^pass  stop +step {stop['step']} by SIGUSR1.*saved and stopped ([\d.]+) s after the signal$", said, re.M
    )
    assert took and 0 < float(took.group(1)) < 600 and re.search(r"^-  +fabric", said, re.M), said


@pytest.mark.timeout(900)
def test_nemo_run_submits_through_its_local_tunnel_and_the_job_completes(cluster):
    """`nemo-dapo launch --executor slurm` on the login node (ctl): NeMo-Run packages the committed
    code, writes its batch script and submits it with sbatch; the job starts Ray over two nodes
    (torch policy ranks at DP=2, one per node) and completes, with the streaming trainer (its
    engine on one node streams while the ranks on both train). Its first node pair includes n2,
    where a file stands at the path of Ray's session folder (a node alive but broken: Ray cannot
    start there): that start-up fails naming n2, goes through the requeue policy, and the requeued
    job excludes n2 and runs on n1 and n3. Its head is held 30 s there (RAY_HEAD_START_DELAY_S, a
    test hook): the workers wait for its port, and the cluster forms."""
    home = cluster.work / "nemorun_home"  # not .../nemo_run/...: NeMo-Run rewrites that
    launch = [sys.executable, "-m", "nemo_dapo.cli", "launch", "--config", "tiny_cpu", "--executor", "slurm"]
    allocation = ["--nodes", "2", "--gpus-per-node", "0", "--time", "00:20:00", "--python", sys.executable]
    run = ["trainer.placement_strategy=SPREAD", "actor.num_workers=2", "trainer.cpu_threads_per_worker=1"]
    run += ["trainer.mode=stream"]
    ray_folder = "/tmp/ray_nemo_run_test"  # RAY_TEMP_DIR: the same path in every run of the job
    env = ["env", f"NEMORUN_HOME={home}", "NODE_MIN_FREE_GIB=1", f"RAY_TEMP_DIR={ray_folder}"]
    env += ["RAY_HEAD_START_DELAY_S=30"]
    cluster.wait_idle()
    cluster.on("n2", "touch", ray_folder)  # n2's own /tmp: a file where Ray's folder must go
    try:
        printed = cluster.on("ctl", *env, *launch, *allocation, *run, "trainer.total_training_steps=3", *SMALL,
                             timeout=300)  # fmt: skip
        ids = cluster.on("ctl", "squeue", "--noheader", "--format=%i", "--name=nemo-dapo-tiny_cpu-train").split()
        assert len(ids) == 1, printed
        job = Job(cluster.env, home / "not-yet.out", ids[0], cluster.prefix)
        job.output = Path(job.field("StdOut"))  # the job may not have started: its file may not be there yet
        try:
            job.release_requeued(1, gone=lambda: not ray_leftovers(job, list(NODES)))
            job.wait_for("completion", lambda: job.field("JobState") == "COMPLETED", timeout=600)
        finally:
            job.run("scancel", job.id)
    finally:
        cluster.on("n2", "rm", "-f", ray_folder)
    named = re.search(r"ray_cluster: the preflight step failed on node\(s\) n2: n2: (.*)", job.log())
    assert named and ray_folder in named.group(1), job.log()[-3000:]
    assert len(re.findall(r"ray_cluster: ready at \S+: nodes 2/2", job.log())) == 1  # its head 30 s late
    assert job.field("Restarts") == "1" and job.field("ExcNodeList") == "n2", job.log()[-3000:]
    logs = home / "experiments" / "nemo-dapo-tiny_cpu" / "logs"
    assert (logs / job.id / "crash_requeues").read_text().split()[0] == "1"  # counted for this job
    trainer_log = "".join(p.read_text() for p in (home / "experiments").rglob("log-nemo-dapo-tiny_cpu-train_*.out"))
    placed = re.search(r"actor: 2 worker\(s\) on 2 node\(s\): (.*)", trainer_log)
    assert placed and set(re.findall(r"10\.77\.0\.\d", placed.group(1))) == {NODES["n1"], NODES["n3"]}, trainer_log
    outputs_dir = home / "experiments" / "nemo-dapo-tiny_cpu" / "outputs"
    assert json.loads((outputs_dir / "summary.json").read_text())["steps"] == 3
    steps = [json.loads(line) for line in (outputs_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["stream/engine_busy"] > 0 for r in steps if "actor/pg_loss" in r] == [True] * 3
    # the trainer's deadline reached it through the job's environment (slurm/job_deadline.sh)
    saved = (outputs_dir / "checkpoints" / "global_step_3" / "config.yaml").read_text()
    save_by = float(re.search(r"save_by: (\S+)", saved).group(1))
    started = datetime.datetime.fromisoformat(job.field("StartTime")).timestamp()
    assert abs(save_by - (started + 20 * 60 - 300)) <= 2, (job.field("StartTime"), save_by)


@pytest.mark.timeout(900)
def test_two_pools_lose_rollout_nodes_and_train_on(cluster, tmp_path):
    """A heterogeneous job: the training pool n1 + n2 (torch ranks at DP=2, one per node), the
    rollout pool n3 + n4 (an engine each). Its first step equals the same layout's on one node.
    n4's Ray is SIGKILLed (the node stays in the job): the run goes on with one engine, the batch
    shell starts n4's Ray again and the engine is back at the next weight sync. Then n3 dies whole
    (a lost node: Slurm takes it out of the --no-kill job): one engine to the end. The job is
    never requeued, and no prompt is lost or trained twice."""
    total = 16
    overrides = [*POOLS, f"trainer.total_training_steps={total}", "trainer.save_freq=0", *SMALL]
    job = cluster.submit(
        "pools", overrides, sbatch_args=POOL_COMPONENTS, RAY_ROLLOUT_CPUS_PER_NODE="1", RAY_NODE_RESTART_S="1"
    )
    out = cluster.work / "pools" / "ckpt"
    try:
        placed = wait_for_line(job, r"rollout: 2 worker\(s\) on 2 node\(s\): (.*)")
        assert set(re.findall(r"10\.77\.0\.\d", placed.group(1))) == {NODES["n3"], NODES["n4"]}
        wait_for_line(job, r"nemo_dapo: step 2: ")
        driver = int((cluster.work / "pools" / "logs" / job.id / "trainer.r0.pid").read_text())
        os.kill(driver, signal.SIGSTOP)  # held while n4's Ray dies and comes back
        kill_ray_on(job, "n4")
        wait_for_line(job, "ray_cluster: starting the Ray of rollout node n4 again")
        job.wait_for("n4's raylet", lambda: any("raylet" in c for *_, c in ray_processes(job, ["n4"])), timeout=60)
        os.kill(driver, signal.SIGCONT)
        wait_for_line(job, r"rollout engine \d: its node 10\.77\.0\.5 is lost .*; engines 2 -> 1")
        wait_for_line(job, r"rollout engine \d is back on node 10\.77\.0\.5; engines 1 -> 2")
        cluster.setup("kill-node", "n3")
        cluster.mark_down("n3")
        wait_for_line(job, r"its node 10\.77\.0\.4 is lost .*; engines 2 -> 1")
        job.wait_for("completion", lambda: job.field("JobState") == "COMPLETED", timeout=400)
    finally:
        job.run("scancel", job.id)
        cluster.setup("start-node", "n3")
    log = job.log()
    assert job.field("Restarts") == "0" and "requeue:" not in log, log[-3000:]
    steps = [row for row in records(out / "metrics.jsonl") if "actor/pg_loss" in row]
    engines = [row["recovery/engines"] for row in steps]
    assert engines[0] == 2 and engines[-1] == 1 and 2 in engines[1:-1], engines
    by_step = last_per_step(records(out / "prompts.jsonl"))
    assert sorted(by_step) == list(range(1, total + 1))
    consumed = [i for step in sorted(by_step) for i in by_step[step]["consumed"]]
    assert consumed == [i for r in expected_rounds(1800, 12, seed=1, count=len(consumed) // 12) for i in r]
    assert json.loads((out / "summary.json").read_text())["steps"] == total
    assert_first_step_as_on_one_node(out, tmp_path / "one_node", [*POOLS, *SMALL])
