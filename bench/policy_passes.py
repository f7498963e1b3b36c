"""Is a policy worker slower inside Ray, and what does keeping freed memory save? One policy
worker's log-prob and training passes on the real model, side by side and alternately: in a plain
process and in a Ray actor started by ``init_ray``, each with glibc's default malloc and with the
settings training workers start with (``trainer.keep_freed_memory``, ``cluster/allocator.py``).

    .venv/bin/python bench/policy_passes.py [--model smollm2-135m-arith] [--rows 64] [--reps 5] [--sittings 2]

Each process builds a ``TorchPolicyWorker`` (bf16 autocast and eager attention, as the preset runs
on an AMX CPU), then times ``--reps`` forward passes (``compute_log_prob``) and forward + backward passes
over a ``--rows`` x 52-token batch of the real vocabulary, cut into the preset's 1024-token
micro-batches. Reported per setting: the median seconds of each pass, and the process's minor page
faults and kernel (system) CPU seconds per repetition of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import _policy_timing
from _policy_timing import forward_backward_s, policy_worker

from nemo_dapo.cluster.allocator import REUSE_FREED_MEMORY


def passes(model: str, rows: int, reps: int) -> dict:
    """In this process: the timed passes, then this process's page faults and system time."""
    import torch

    from nemo_dapo.policy.microbatch import micro_batches

    worker = policy_worker(model, "bfloat16")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, worker.model.config.vocab_size, (rows, 52), generator=gen)
    attention = torch.ones_like(ids)
    batch = {
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": attention.cumsum(1) - 1,
        "responses": ids[:, 40:],
        "loss_mask": attention[:, 40:],
    }
    forward, train = [], []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(reps):
        start = time.perf_counter()
        worker.compute_log_prob(batch)
        forward.append(time.perf_counter() - start)
        train.append(forward_backward_s(worker, micro_batches(batch, 1024)))
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "forward_s": statistics.median(forward),
        "forward_backward_s": statistics.median(train),
        "minor_faults_per_rep": (after.ru_minflt - before.ru_minflt) / reps,
        "system_s_per_rep": (after.ru_stime - before.ru_stime) / reps,
    }


def run(where: str, env: dict, args) -> dict:
    command = [sys.executable, __file__, f"--child={where}", "--model", args.model, "--rows", str(args.rows)]
    command += ["--reps", str(args.reps)]
    out = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def in_ray_actor(args) -> dict:
    """The passes in a Ray actor on a local Ray, as the trainer starts its workers."""
    from nemo_dapo.cluster.ray_env import init_ray, shutdown_ray

    ray = init_ray(num_cpus=os.cpu_count())
    # bench/ is not on the Ray workers' import path: the helpers travel pickled with `passes`
    ray.cloudpickle.register_pickle_by_value(_policy_timing)
    try:
        return ray.get(ray.remote(num_cpus=1)(passes).remote(args.model, args.rows, args.reps))
    finally:
        shutdown_ray()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-arith")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sittings", type=int, default=2)
    parser.add_argument("--child", choices=("process", "ray"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(passes(args.model, args.rows, args.reps) if args.child == "process" else in_ray_actor(args)))
        return
    settings = {
        "process, glibc default": ("process", {}),
        "process, freed memory kept": ("process", REUSE_FREED_MEMORY),
        "Ray actor, glibc default": ("ray", {}),
        "Ray actor, freed memory kept": ("ray", REUSE_FREED_MEMORY),
    }
    results: dict[str, list[dict]] = {name: [] for name in settings}
    for _ in range(args.sittings):
        for name, (where, env) in settings.items():
            results[name].append(run(where, env, args))
    for name, runs in results.items():
        summary = {key: statistics.mean(r[key] for r in runs) for key in runs[0]}
        print(f"{name:>26}: " + ", ".join(f"{key} {value:.3g}" for key, value in summary.items()))


if __name__ == "__main__":
    main()
