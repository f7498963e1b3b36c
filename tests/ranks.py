"""Run a function on N torch.distributed ranks (gloo over loopback), each in its own process.

The ranks start from a forkserver that has imported torch, megatron-core and our Megatron
worker once per test session: a fresh ``spawn`` re-imports them in every rank of every test
(6-10 s each on 2 cores, for some 50 launches). The forkserver never runs a torch kernel, so
its children start with no thread pool and set their own threads, as a spawned rank would.

A forkserver child inherits the environment the server started with, not the caller's
current one, so the caller's environment travels with the call and is applied in each rank.
"""

from __future__ import annotations

import os

# what every rank imports; megatron-core's modules are imported lazily by our worker, so named here
PRELOAD = [
    "torch",
    "transformers",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing",
    "nemo_dapo.policy.megatron.worker",
    "tests.ranks",
]
_started = False


def _with_environment(rank: int, environment: dict, fn, world_size: int, *args) -> None:
    os.environ.clear()
    os.environ.update(environment)
    fn(rank, world_size, *args)


def spawn(fn, world_size: int, *args) -> None:
    """``fn(rank, world_size, *args)`` on ranks 0..world_size-1; raises if any rank fails."""
    import torch.multiprocessing as mp

    global _started
    if not _started:
        mp.set_forkserver_preload(PRELOAD)
        _started = True
    environment = {"GLOO_SOCKET_IFNAME": "lo", **os.environ}
    mp.start_processes(
        _with_environment,
        args=(environment, fn, world_size, *args),
        nprocs=world_size,
        start_method="forkserver",
        join=True,
    )
