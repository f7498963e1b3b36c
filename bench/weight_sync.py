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

``--across-nodes`` (attached to a Ray cluster of two nodes or more through ``$RAY_ADDRESS``; run
by ``bench/weight_sync_two_nodes.py`` on the namespace cluster): the policy rank (TP=1) and the
engine (TP=1) on different nodes (a STRICT_SPREAD placement group), the plain broadcast between
two tasks on those nodes, and the bytes counted on the driver's node's network interfaces
(every one but ``lo``: the sync's payload crosses it once, whichever node holds which side).
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
from nemo_dapo.cluster.placement import Slot, reserve
from nemo_dapo.cluster.ray_env import init_ray, shutdown_ray
from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup
from nemo_dapo.config.schema_actor import MegatronConfig, OptimConfig
from nemo_dapo.model.tiny import ensure_tiny_model
from nemo_dapo.policy.base import WorkerSettings
from nemo_dapo.sealed_store import new_secret


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


def nic_bytes() -> dict[str, int]:
    """Bytes sent and received on each of this node's interfaces but loopback."""
    return {nic: c.bytes_sent + c.bytes_recv for nic, c in psutil.net_io_counters(pernic=True).items() if nic != "lo"}


def network_bytes() -> int:
    return sum(nic_bytes().values())


def across_nodes_broadcast(group, total_bytes: int, bucket_bytes: int) -> float:
    """Seconds for a bare gloo broadcast from bundle 0's node to bundle 1's, as Ray tasks."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def on(bundle: int):
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)}

    address = ray.get(ray.remote(ray.util.get_node_ip_address).options(num_cpus=1, **on(0)).remote())
    rank = ray.remote(_broadcast_rank)
    port, secret = 29517, new_secret()
    ranks = [
        rank.options(num_cpus=1, **on(b)).remote(b, 2, port, total_bytes, bucket_bytes, None, secret, address)
        for b in (0, 1)
    ]
    return ray.get(ranks[0])


def plain_broadcast(total_bytes: int, bucket_bytes: int, receivers: int) -> float:
    """Seconds for a bare gloo broadcast of ``total_bytes`` in buckets, rank 0 to ``receivers``."""
    import torch.multiprocessing as mp

    port, secret = _free_port(), new_secret()
    context = mp.get_context("spawn")
    procs = [context.Process(target=_broadcast_rank, args=(r, receivers + 1, port, total_bytes, bucket_bytes, None,
                                                           secret)) for r in range(1, receivers + 1)]  # fmt: skip
    for proc in procs:
        proc.start()
    result = context.Queue()
    _broadcast_rank(0, receivers + 1, port, total_bytes, bucket_bytes, result, secret)
    for proc in procs:
        proc.join()
    return result.get()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _broadcast_rank(
    rank: int, world: int, port: int, total: int, bucket: int, result, secret: str, host: str = "127.0.0.1"
) -> float | None:
    """One rank of the bare broadcast; rank 0 serves the store, whose keys the ranks seal with
    ``secret`` (nemo_dapo/sealed_store.py), as every group's ranks do."""
    import torch

    from nemo_dapo.transfer.gloo import gloo_group
    from nemo_dapo.transfer.wire import broadcast

    if rank == 0:
        import torch.distributed as dist

        server = dist.TCPStore(host, port, world, True)  # noqa: F841 (served while the group forms)
    group = gloo_group(f"tcp://{secret}@{host}:{port}", rank, world, 600)
    buffer = torch.ones(bucket, dtype=torch.uint8)
    broadcast(group, buffer)  # connections warm
    start = time.perf_counter()
    for offset in range(0, total, bucket):
        broadcast(group, buffer[: min(bucket, total - offset)])
    if result is not None:
        result.put(time.perf_counter() - start)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2, help="the policy's tensor-parallel ranks")
    parser.add_argument("--engine-tp", type=int, default=1, help="the engine's tensor-parallel workers")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--across-nodes", action="store_true", help="policy and engine on two nodes of $RAY_ADDRESS")
    parser.add_argument("--workdir", help="where the model is written (a folder every node sees; default: /tmp)")
    args = parser.parse_args()
    if args.across_nodes and (args.tp, args.engine_tp) != (1, 1):
        parser.error("--across-nodes runs one policy rank and one engine worker: --tp 1 --engine-tp 1")
    from nemo_dapo.cluster.weight_sync import CollectiveSync, ObjectStoreSync
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker
    from nemo_dapo.rollout.base import EngineSettings
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    folder = Path(tempfile.mkdtemp(prefix="weight_sync_", dir=args.workdir))
    model_bytes = build_model(args.hidden, args.layers, folder)
    bucket_bytes = args.bucket_mib << 20
    init_ray(num_cpus=args.tp + args.engine_tp + 1)
    count_bytes = network_bytes if args.across_nodes else loopback_bytes
    try:
        spread = reserve([{"CPU": 1}] * 2, "STRICT_SPREAD", "two nodes", 120) if args.across_nodes else None
        policy = PolicyGroup(
            WorkerGroup(
                MegatronPolicyWorker,
                GroupSpec("policy", args.tp, slots=[Slot(spread, 0, 1, 0)] if spread else None),
                {
                    "settings": WorkerSettings(str(folder), OptimConfig(), num_threads=1),
                    "layout": MegatronConfig(tensor_model_parallel_size=args.tp),
                },
            )
        )
        engine = EngineSettings(str(folder), 256, tensor_parallel_size=args.engine_tp, weight_transfer="gloo")
        rollout = RolloutGroup(
            WorkerGroup(
                VLLMRolloutWorker,
                GroupSpec("rollout", 1, slots=[Slot(spread, 1, 1, 0)] if spread else None),
                {"settings": engine},
            )
        )
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
        by_nic: dict[str, dict[str, float]] = {}  # the last sync's MiB on each interface but lo
        version = 0
        for _ in range(args.syncs):
            for name, sync in paths.items():
                version += 1
                sent, nics, start = count_bytes(), nic_bytes(), time.perf_counter()
                sync(version)
                seconds[name].append(time.perf_counter() - start)
                wire[name].append(count_bytes() - sent)
                by_nic[name] = {nic: (moved - nics.get(nic, 0)) / 2**20 for nic, moved in nic_bytes().items()}
        memory.stop()
        if spread:
            policy.workers.shutdown()  # the bare broadcast takes their CPUs
            rollout.workers.shutdown()
            plain = across_nodes_broadcast(spread, model_bytes, bucket_bytes)
        else:
            plain = plain_broadcast(model_bytes, bucket_bytes, args.engine_tp)
        result = {
            "model_mib": model_bytes / 2**20,
            "policy_tp": args.tp,
            "engine_tp": args.engine_tp,
            "bucket_mib": args.bucket_mib,
            "seconds_per_sync": seconds,
            f"{'network' if spread else 'loopback'}_mib_per_sync": {
                name: [b / 2**20 for b in values] for name, values in wire.items()
            },
            "gloo_payload_mib": paths["gloo"].sent_bytes / 2**20,
            **({"last_sync_mib_by_interface": by_nic} if spread else {}),
            "plain_gloo_broadcast_s": plain,
            "peak_growth_mib": None if spread else (memory.peak_bytes - baseline) / 2**20,  # workers elsewhere
        }
        print(json.dumps(result, indent=2))
    finally:
        shutdown_ray()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
