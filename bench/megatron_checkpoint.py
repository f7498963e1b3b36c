"""How long does a Megatron checkpoint hold training up, per optimizer format, side by side?

    .venv/bin/python bench/megatron_checkpoint.py [--hidden 1024] [--layers 8] [--dp 2] [--saves 3]

Writes a random Qwen2-shaped model, then for each ``actor.megatron.optimizer_checkpoint`` format
starts ``--dp`` data-parallel ranks (spawned; gloo on 127.0.0.1, or NCCL on GPUs), each builds a
``MegatronPolicyWorker`` (``--dtype`` weights) and takes one optimizer step, and times on rank 0: ``--saves``
asynchronous saves (the call, which training waits for, then the wait for the background write
to end) and one synchronous save, plus the checkpoint's size on disk. The first asynchronous call
carries one-time set-up, so ``async_call_s`` is the mean of the later ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_megatron_smoke import dapo_update, synthetic_batch
from weight_sync import build_model

FORMATS = ("fully_reshardable", "dp_reshardable")


def _timed(action) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    action()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def one_step(worker) -> None:
    """One update on random rows (the GPU smoke's), so the optimizer holds real Adam moments."""
    from nemo_dapo.policy.base import LossSettings

    batch = synthetic_batch(rows=4, prompt=32, response=32, vocab=400, seed=worker.rank)
    dapo_update(worker, batch, worker.compute_log_prob(batch), LossSettings())


def _remove_on_rank0(rank: int, path: str) -> None:
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)


def save_rank(rank: int, world_size: int, folder: str, out: str, optimizer_format: str, saves: int, dtype: str) -> None:
    from nemo_dapo.config.schema_actor import MegatronConfig, OptimConfig
    from nemo_dapo.policy.base import WorkerSettings
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker

    worker = MegatronPolicyWorker(
        rank,
        world_size,
        os.path.join(out, f"rdv_{optimizer_format}"),
        WorkerSettings(folder, OptimConfig(), dtype=dtype),
        MegatronConfig(optimizer_checkpoint=optimizer_format),
    )
    one_step(worker)
    root = Path(out, optimizer_format)
    calls, waits = [], []
    for i in range(saves):
        path = str(root / f"async{i}")
        calls.append(_timed(lambda path=path: worker.save(path, asynchronous=True)))
        waits.append(_timed(lambda: worker.finish_save(blocking=True)))
        _remove_on_rank0(worker.rank, path)  # a GPU machine's disk holds few of them
    sync_s = _timed(lambda: worker.save(str(root / "sync")))
    size = sum(p.stat().st_size for p in (root / "sync" / "megatron").rglob("*") if p.is_file())
    _remove_on_rank0(worker.rank, str(root / "sync"))
    if rank == 0:
        later = calls[1:] or calls
        result = {
            "format": optimizer_format,
            "first_async_call_s": round(calls[0], 2),
            "async_call_s": round(sum(later) / len(later), 2),
            "async_wait_s": [round(w, 2) for w in waits],
            "sync_save_s": round(sync_s, 2),
            "megatron_state_mib": round(size / 2**20),
        }
        Path(out, f"{optimizer_format}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (one per GPU on GPUs)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="the weights' dtype (bfloat16 as on GPUs)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    folder, out = Path(tempfile.mkdtemp(prefix="ckpt_model_")), tempfile.mkdtemp(prefix="ckpt_bench_")
    parameter_mib = build_model(args.hidden, args.layers, folder) / 2**20
    results = []
    for optimizer_format in FORMATS:
        mp.start_processes(
            save_rank,
            args=(args.dp, str(folder), out, optimizer_format, args.saves, args.dtype),
            nprocs=args.dp,
            start_method="spawn",
        )
        results.append(json.loads(Path(out, f"{optimizer_format}.json").read_text()))
        print(json.dumps(results[-1]), flush=True)
    shutil.rmtree(folder)
    shutil.rmtree(out)
    summary = {"parameter_mib": round(parameter_mib), "dp": args.dp, "dtype": args.dtype, "results": results}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
