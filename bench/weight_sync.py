"""How long does a weight sync (policy -> vLLM engines) take, and how much memory does it add?

    .venv/bin/python bench/weight_sync.py [--hidden 1024] [--layers 8] [--tp 2] [--bucket-mib 64] [--syncs 3]

Builds a randomly initialised Qwen2-shaped model of the given size (the tiny tokenizer), starts
a Megatron policy group (TP ranks in Ray actors, gloo on the CPU) and one vLLM engine, then times
``RolloutGroup.update_weights(PolicyGroup.export_weights(...))``: the streamed path the trainer
uses (per-layer TP gathers, buckets on bounded queues). Prints seconds per sync, MB/s, the
bucket count and the peak growth of the resident memory of all processes during the syncs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from step_breakdown import TreeMemory

from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
from nemo_dapo.cluster.ray_env import init_ray, shutdown_ray
from nemo_dapo.cluster.worker_group import WorkerGroup
from nemo_dapo.config.schema import MegatronConfig, OptimConfig
from nemo_dapo.model.tiny import ensure_tiny_model


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


def counted(stream, seen: list):
    """Pass the bucket refs through, noting each."""
    for ref in stream:
        seen.append(None)
        yield ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--syncs", type=int, default=3)
    args = parser.parse_args()
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    folder = Path(tempfile.mkdtemp(prefix="weight_sync_"))
    model_bytes = build_model(args.hidden, args.layers, folder)
    init_ray(num_cpus=args.tp + 2)
    try:
        policy = PolicyGroup(
            WorkerGroup(
                MegatronPolicyWorker,
                args.tp,
                name="policy",
                worker_kwargs={
                    "model_path": str(folder),
                    "optim": OptimConfig(),
                    "layout": MegatronConfig(tensor_model_parallel_size=args.tp),
                    "num_threads": 1,
                },
            )
        )
        rollout = RolloutGroup(
            WorkerGroup(
                VLLMRolloutWorker, 1, name="rollout", worker_kwargs={"model_path": str(folder), "max_model_len": 256}
            )
        )
        memory = TreeMemory()
        memory.start()
        time.sleep(1.0)
        baseline = memory.peak_bytes
        seconds, buckets = [], []
        for version in range(1, args.syncs + 1):
            start = time.perf_counter()
            rollout.update_weights(counted(policy.export_weights(args.bucket_mib << 20), buckets), version)
            seconds.append(time.perf_counter() - start)
        memory.stop()
        result = {
            "model_mib": model_bytes / 2**20,
            "tp": args.tp,
            "bucket_mib": args.bucket_mib,
            "buckets": len(buckets) // args.syncs,
            "seconds_per_sync": seconds,
            "mib_per_s": model_bytes / 2**20 / min(seconds),
            "peak_growth_mib": (memory.peak_bytes - baseline) / 2**20,
        }
        print(json.dumps(result, indent=2))
    finally:
        shutdown_ray()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
