"""How long does a weight sync (policy -> vLLM engines) take on each path, how many bytes does it
move, and how much memory does it add?

    .venv/bin/python bench/weight_sync.py [--hidden 1024] [--layers 8] [--tp 2] [--engine-tp 1]
        [--bucket-mib 64] [--syncs 3]

Builds a randomly initialised Qwen2-shaped model of the given size (the tiny tokenizer), starts
a Megatron policy group (TP ranks in Ray actors, gloo on the CPU) and one vLLM engine, then
syncs alternately over the two paths of ``rollout.weight_transfer`` (cluster/weight_sync.py):
``object_store`` (buckets through Ray's object store and a queue, then vLLM's executor to each
TP worker) and ``gloo`` (the exporting rank broadcasts to every engine worker). Also times a
plain gloo broadcast of the same bytes in the same buckets between two bare processes, the
bound for the collective path on this link. Prints seconds per sync, bytes through the loopback
interface per sync (what crossed a socket: TCP's payload on ``lo``) and the peak growth of the
resident memory of all processes during the syncs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import psutil
from step_breakdown import TreeMemory

from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
from nemo_dapo.cluster.ray_env import init_ray, shutdown_ray
from nemo_dapo.cluster.worker_group import WorkerGroup
from nemo_dapo.config.schema_actor import MegatronConfig, OptimConfig
from nemo_dapo.model.tiny import ensure_tiny_model
from nemo_dapo.policy.base import WorkerSettings


def build_model(hidden: int, layers: int, folder: Path) -> int:
    """A random Qwen2 model with the tiny model's tokenizer; returns its parameter bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = Path(ensure_tiny_model())
    config = AutoConfig.from_pretrained(tiny)
    config.update(
        {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "intermediate_size": 4 * hidden,
            "num_attention_heads": hidden // 64,
            "num_key_value_heads": max(2, hidden // 256),
            "layer_types": ["full_attention"] * layers,
            "head_dim": 64,
        }
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    for name in tiny.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation")):
            shutil.copy(name, folder / name.name)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def loopback_bytes() -> int:
    return psutil.net_io_counters(pernic=True)["lo"].bytes_sent


def plain_broadcast(total_bytes: int, bucket_bytes: int, receivers: int) -> float:
    """Seconds for a bare gloo broadcast of ``total_bytes`` in buckets, rank 0 to ``receivers``."""
    import torch.multiprocessing as mp

    port = _free_port()
    context = mp.get_context("spawn")
    procs = [context.Process(target=_broadcast_rank, args=(r, receivers + 1, port, total_bytes, bucket_bytes, None))
             for r in range(1, receivers + 1)]  # fmt: skip
    for proc in procs:
        proc.start()
    result = context.Queue()
    _broadcast_rank(0, receivers + 1, port, total_bytes, bucket_bytes, result)
    for proc in procs:
        proc.join()
    return result.get()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _broadcast_rank(rank: int, world: int, port: int, total: int, bucket: int, result) -> None:
    import torch

    from nemo_dapo.transfer.gloo import gloo_group
    from nemo_dapo.transfer.wire import broadcast

    if rank == 0:
        import torch.distributed as dist

        server = dist.TCPStore("127.0.0.1", port, world, True)  # noqa: F841 (served while the group forms)
    group = gloo_group(f"tcp://127.0.0.1:{port}", rank, world, 600)
    buffer = torch.ones(bucket, dtype=torch.uint8)
    broadcast(group, buffer)  # connections warm
    start = time.perf_counter()
    for offset in range(0, total, bucket):
        broadcast(group, buffer[: min(bucket, total - offset)])
    if result is not None:
        result.put(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2, help="the policy's tensor-parallel ranks")
    parser.add_argument("--engine-tp", type=int, default=1, help="the engine's tensor-parallel workers")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--syncs", type=int, default=3)
    args = parser.parse_args()
    from nemo_dapo.cluster.weight_sync import CollectiveSync, ObjectStoreSync
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker
    from nemo_dapo.rollout.base import EngineSettings
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    folder = Path(tempfile.mkdtemp(prefix="weight_sync_"))
    model_bytes = build_model(args.hidden, args.layers, folder)
    bucket_bytes = args.bucket_mib << 20
    init_ray(num_cpus=args.tp + args.engine_tp + 1)
    try:
        policy = PolicyGroup(
            WorkerGroup(
                MegatronPolicyWorker,
                args.tp,
                name="policy",
                worker_kwargs={
                    "settings": WorkerSettings(str(folder), OptimConfig(), num_threads=1),
                    "layout": MegatronConfig(tensor_model_parallel_size=args.tp),
                },
            )
        )
        engine = EngineSettings(str(folder), 256, tensor_parallel_size=args.engine_tp, weight_transfer="gloo")
        rollout = RolloutGroup(WorkerGroup(VLLMRolloutWorker, 1, name="rollout", worker_kwargs={"settings": engine}))
        paths = {
            "object_store": ObjectStoreSync(policy, rollout, bucket_bytes),
            "gloo": CollectiveSync(policy, rollout, bucket_bytes),
        }
        memory = TreeMemory()
        memory.start()
        time.sleep(1.0)
        baseline = memory.peak_bytes
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        wire: dict[str, list[int]] = {name: [] for name in paths}
        version = 0
        for _ in range(args.syncs):
            for name, sync in paths.items():
                version += 1
                sent, start = loopback_bytes(), time.perf_counter()
                sync(version)
                seconds[name].append(time.perf_counter() - start)
                wire[name].append(loopback_bytes() - sent)
        memory.stop()
        plain = plain_broadcast(model_bytes, bucket_bytes, args.engine_tp)
        result = {
            "model_mib": model_bytes / 2**20,
            "policy_tp": args.tp,
            "engine_tp": args.engine_tp,
            "bucket_mib": args.bucket_mib,
            "seconds_per_sync": seconds,
            "loopback_mib_per_sync": {name: [b / 2**20 for b in values] for name, values in wire.items()},
            "gloo_payload_mib": paths["gloo"].sent_bytes / 2**20,
            "plain_gloo_broadcast_s": plain,
            "peak_growth_mib": (memory.peak_bytes - baseline) / 2**20,
        }
        print(json.dumps(result, indent=2))
    finally:
        shutdown_ray()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
