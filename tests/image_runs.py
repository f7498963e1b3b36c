"""The CPU image at work (`make image-test`, after `make image-cpu`; not in `make test`, whose
CI run has no time to build an image): the embedded default inside the image learns as it does
outside, and the two-node job of slurm/dapo_tiny_cpu.sbatch runs every step (Ray head, worker,
readiness check, trainer) in its own podman container on the namespace cluster."""

import json
import os
import subprocess

import pytest

from tests.slurm_jobs import REPO
from tests.test_multinode import (  # noqa: F401 (cluster: a fixture)
    CLI,
    TWO_NODES,
    assert_first_step_as_on_one_node,
    cluster,
    wait_for_line,
)
from tests.train_runs import records

IMAGE = os.environ.get("IMAGE", "localhost/nemo-dapo:cpu")
PODMAN_ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "containers" / "podman.conf")}


@pytest.fixture(scope="module", autouse=True)
def image() -> None:
    found = subprocess.run(["podman", "image", "exists", IMAGE], env=PODMAN_ENV)
    if found.returncode != 0:
        pytest.fail(f"no image {IMAGE}: build it with `make image-cpu`")


def podman_run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["podman", "run", "--rm", *args], env=PODMAN_ENV, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(900)
def test_the_embedded_default_learns_in_the_image_as_outside(tmp_path):
    """`nemo-dapo train` in the image, with no network but its own loopback (and the machine's /dev/shm
    for Ray's object store): held-out accuracy
    rises, and every step's numbers equal the same run's outside the image, bit for bit (one lock,
    one arithmetic)."""
    steps = ["trainer.total_training_steps=30", "trainer.test_freq=30", "trainer.save_freq=0"]
    inside = podman_run(
        "--network=none", "--ipc=host", "--volume", f"{tmp_path}:{tmp_path}", IMAGE,
        "nemo-dapo", "train", f"trainer.output_dir={tmp_path / 'inside'}", *steps, timeout=840,
    )  # fmt: skip
    assert inside.returncode == 0, inside.stderr[-3000:]
    outside = subprocess.run(
        [*CLI, "train", f"trainer.output_dir={tmp_path / 'outside'}", *steps], capture_output=True, text=True
    )
    assert outside.returncode == 0, outside.stderr[-3000:]
    summary = json.loads((tmp_path / "inside" / "summary.json").read_text())
    print("inside:", {k: summary[k] for k in ("initial_val_acc", "final_val_acc", "steps", "wall_s")})
    assert summary["steps"] == 30 and summary["final_val_acc"] > summary["initial_val_acc"] + 0.03, summary
    rows = [records(tmp_path / side / "metrics.jsonl") for side in ("inside", "outside")]
    for name in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm"):
        assert [r.get(name) for r in rows[0]] == [r.get(name) for r in rows[1]], name
    assert summary == {**json.loads((tmp_path / "outside" / "summary.json").read_text()), "wall_s": summary["wall_s"]}


def containers_of(job_id: str) -> list[dict]:
    """The podman containers of a Slurm job (slurm/ray_cluster.sh labels them), on any node: the
    namespace cluster's nodes share one podman storage."""
    listed = subprocess.run(
        ["podman", "ps", "--all", "--format", "json", "--filter", f"label=nemo-dapo.job={job_id}"],
        env=PODMAN_ENV, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(listed.stdout or "[]")


@pytest.mark.timeout(900)
def test_the_two_node_job_runs_every_step_in_a_container(cluster, tmp_path):  # noqa: F811 (the fixture)
    """dapo_tiny_cpu.sbatch on two namespace nodes with CONTAINER_RUNTIME=podman: the head, the
    worker and the trainer run in the image (its Python, not this checkout's environment), the
    trainer reaches the head's sockets through the node's Ray folder, and the first step equals
    the same layout's on one node outside any container."""
    cache = cluster.work / "podman" / "model_cache"  # the built-in model, built once for every node
    cache.mkdir(parents=True)
    job = cluster.submit(
        "podman",
        [*TWO_NODES, "trainer.total_training_steps=4", "trainer.save_freq=0"],
        NEMO_DAPO_CACHE=str(cache),
        CONTAINER_MOUNTS=f"{cache}:{cache}",
        CONTAINER=IMAGE,
        CONTAINER_RUNTIME="podman",
        CONTAINERS_CONF=PODMAN_ENV["CONTAINERS_CONF"],
        PYTHON="python3",
    )
    try:
        wait_for_line(job, r"nemo_dapo: step 1: ", timeout=420)
        running = containers_of(job.id)
        job.wait_for("completion", lambda: job.field("JobState") == "COMPLETED", timeout=420)
    finally:
        job.run("scancel", job.id)
    commands = [" ".join(c["Command"]) for c in running if c["Image"] == IMAGE]
    assert sum("ray_node.sh ray head --head --block" in c for c in commands) == 1, commands  # `ray start` in it
    assert sum("ray_node.sh ray worker --block --address=" in c for c in commands) == 1, commands
    assert sum("nemo_dapo.cli train" in c for c in commands) == 1, commands
    job.wait_for("the containers removed", lambda: not containers_of(job.id), timeout=30)  # --rm, by conmon
    out = cluster.work / "podman" / "ckpt"
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    # each node's Ray session logs, copied out of the container to LOG_DIR when its Ray stopped
    kept = cluster.work / "podman" / "logs" / job.id / "nodes"
    assert (kept / "n1" / "r0" / "gcs_server.out").is_file() and (kept / "n2" / "r0" / "raylet.out").is_file()
    assert_first_step_as_on_one_node(out, tmp_path / "one_node")
