"""Save / load a Megatron policy worker with ``dist_checkpointing`` (torch_dist format).

The model and the distributed optimizer are saved as sharded tensors in a layout-independent
form (optimizer sharding type ``fully_reshardable``), so a checkpoint written at one TP / PP /
DP layout loads at another. The step counter goes into the common state; RNG states are per
rank, beside the checkpoint (absent ranks keep theirs, as in the torch worker). A gathered
Hugging Face copy of the weights (``model/``) is written too, as by the torch worker.

Asynchronous saves write the sharded state from a forked process (megatron-core's async
``dist_checkpointing``): the fork holds the state as it was when the save began, training goes
on, and the checkpoint is complete once :func:`finish_async_saves` reports every rank done.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from nemo_dapo.policy.megatron.cpu_compat import (
    init_fallback_adam_state,
    skip_step_when_restoring_adam_state,
    unshare_adam_steps,
)

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state(worker, is_loading: bool) -> dict:
    """Model chunks (tensor keys use model-wide layer indices, so any PP / virtual-stage layout
    loads any other), the optimizer over all of them, and the step counter."""
    chunk_states = {f"model{i}": model.sharded_state_dict() for i, model in enumerate(worker.models)}
    model_state = chunk_states["model0"] if len(chunk_states) == 1 else chunk_states
    init_fallback_adam_state(worker.optimizer)  # a load template, or a save before the first step
    optimizer_state = worker.optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA
    )
    return {"model": model_state, "optimizer": optimizer_state, "steps_done": worker.steps_done}


def save_checkpoint(worker, path: str, asynchronous: bool = False) -> None:
    """Collective. With ``asynchronous`` the sharded state is still being written on return."""
    from megatron.core import dist_checkpointing

    weights_dir = os.path.join(path, "megatron")
    if worker.rank == 0:
        os.makedirs(weights_dir, exist_ok=True)
    dist.barrier()
    worker.gather_params()
    request = dist_checkpointing.save(
        _sharded_state(worker, is_loading=False), weights_dir, async_sharded_save=asynchronous
    )
    if asynchronous:
        worker.async_saves.schedule_async_request(request)
    torch.save(worker.rng_state(), os.path.join(path, f"rng_rank{worker.rank}.pt"))
    _save_hf_weights(worker, os.path.join(path, "model"))
    dist.barrier()


def _save_hf_weights(worker, folder: str) -> None:
    """A Hugging Face copy of the weights beside the sharded state, for export and serving (collective).

    Each pipeline stage's exporting rank writes its own safetensors shard (never the whole model on
    one rank); rank 0 writes the index, as ``save_pretrained`` does for a sharded model.
    """
    from safetensors.torch import save_file

    # clone: a tied lm_head shares the embedding's storage, which safetensors refuses
    weights = {
        name: tensor.detach().contiguous().clone()
        for bucket in worker.export_weights(1 << 62)
        for name, tensor in bucket
    }
    names_per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(names_per_rank, {name: t.numel() * t.element_size() for name, t in weights.items()})
    exporters = [rank for rank, names in enumerate(names_per_rank) if names]
    shards = [names_per_rank[rank] for rank in exporters]
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    os.makedirs(folder, exist_ok=True)
    if weights:
        save_file(weights, os.path.join(folder, files[exporters.index(worker.rank)]))
    if worker.rank == 0:
        worker.hf_config.save_pretrained(folder)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(sum(s.values()) for s in shards)},
                "weight_map": {name: file for file, names in zip(files, shards) for name in names},
            }
            with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
                json.dump(index, handle, indent=2)


def finish_async_saves(worker, blocking: bool) -> bool:
    """Collective: whether every rank's background writes are done (then finalised: metadata
    written, errors raised on all ranks); ``blocking`` waits for them."""
    worker.async_saves.maybe_finalize_async_calls(blocking=blocking)
    return worker.async_saves.get_num_unfinalized_calls() == 0


def load_checkpoint(worker, path: str) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded_state(worker, is_loading=True), os.path.join(path, "megatron"))
    model_state = loaded["model"]
    for i, model in enumerate(worker.models):
        model.load_state_dict(model_state if len(worker.models) == 1 else model_state[f"model{i}"])
    skip_step_when_restoring_adam_state()
    worker.optimizer.load_state_dict(loaded["optimizer"])
    unshare_adam_steps(worker.optimizer)
    worker.steps_done = int(loaded["steps_done"])
    rng_file = os.path.join(path, f"rng_rank{worker.rank}.pt")
    if os.path.exists(rng_file):
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
