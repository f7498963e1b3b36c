"""How much host memory does each Megatron rank peak at while it builds its model from a checkpoint?

    .venv/bin/python bench/worker_startup_memory.py [--hidden 1024] [--layers 8] [--pp 2] [--tp 1]

Writes a random Qwen2-shaped model (fp32 safetensors), starts PP x TP ranks (spawned, gloo on
127.0.0.1), each builds a ``MegatronPolicyWorker`` (model, DDP buffers, distributed optimizer),
and prints each rank's peak resident memory (``ru_maxrss``) and build time, next to the
checkpoint's size. A rank reads only its pipeline chunk's (and EP rank's) tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp
from weight_sync import build_model


def build_rank(rank: int, world_size: int, folder: str, out: str, pp: int, tp: int) -> None:
    from nemo_dapo.config.schema_actor import MegatronConfig, OptimConfig
    from nemo_dapo.policy.base import WorkerSettings
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker

    start = time.perf_counter()
    MegatronPolicyWorker(
        rank,
        world_size,
        os.path.join(out, "rdv"),
        WorkerSettings(folder, OptimConfig(), num_threads=1),
        MegatronConfig(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp),
    )
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "peak_rss_mib": round(peak_mib), "build_s": round(time.perf_counter() - start, 1)})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    folder, out = Path(tempfile.mkdtemp(prefix="startup_model_")), tempfile.mkdtemp(prefix="startup_")
    checkpoint_mib = build_model(args.hidden, args.layers, folder) / 2**20
    world = args.pp * args.tp
    mp.start_processes(build_rank, args=(world, str(folder), out, args.pp, args.tp), nprocs=world, start_method="spawn")
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    print(json.dumps({"checkpoint_mib": round(checkpoint_mib), "pp": args.pp, "tp": args.tp, "ranks": ranks}))


if __name__ == "__main__":
    main()
