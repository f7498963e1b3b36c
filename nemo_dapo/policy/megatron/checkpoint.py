"""Save / load a Megatron policy worker with ``dist_checkpointing`` (torch_dist format).

The model is saved as sharded tensors in a layout-independent form, so its weights load at any
TP / PP / DP layout. The distributed optimizer is saved as ``actor.megatron.optimizer_checkpoint``
says: ``dp_reshardable`` (each rank's own shard; loads at another DP size only) or
``fully_reshardable`` (gathered per parameter; loads at any layout, at the cost of that gather at
every save). The format and the layout it depends on go into the checkpoint's content metadata,
so a load reads the format from the checkpoint and refuses, with the fix, a layout it cannot
take. The step counter goes into the common state; RNG states are per rank, beside the
checkpoint (absent ranks keep theirs, as in the torch worker). A gathered Hugging Face copy of
the weights (``model/``) is written too, as by the torch worker.

Asynchronous saves write the sharded state from a forked process (megatron-core's async
``dist_checkpointing``) and the Hugging Face copy from a thread, off a host copy of the weights:
both hold the state as it was when the save began, training goes on, and the checkpoint is
complete once :func:`finish_async_saves` reports every rank done.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nemo_dapo.config.schema_actor import MegatronConfig
from nemo_dapo.errors import InputError
from nemo_dapo.policy.megatron.cpu_compat import (
    init_fallback_adam_state,
    skip_step_when_restoring_adam_state,
    unshare_adam_steps,
)
from nemo_dapo.policy.weights import Bucket
from nemo_dapo.rng import restore_rng, rng_state
from nemo_dapo.safe_load import checked_distributed_checkpoint, load_state

FORMAT_KEY = "distrib_optim_sharding_type"  # megatron-core's name for the optimizer's format
# What a dp_reshardable optimizer shard's bucket layout depends on, besides the DP size
BUCKET_LAYOUT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "ddp_bucket_size",
    "overlap_grad_reduce",
)


class CheckpointedWorker(Protocol):
    """What saving and loading read and set on a Megatron worker (``MegatronPolicyWorker``)."""

    rank: int
    layout: MegatronConfig
    models: list  # the GPTModel chunks
    optimizer: Any  # megatron-core's (distributed) optimizer
    steps_done: int
    hf_config: Any  # the model folder's transformers config, saved beside the HF copy

    @property
    def async_saves(self) -> Any: ...  # megatron-core's AsyncCallsQueue

    @property
    def background_writes(self) -> BackgroundWrites: ...

    def gather_params(self) -> None: ...

    def export_weights(self, bucket_bytes: int = ...) -> Iterator[Bucket]: ...


class CheckpointLayoutError(InputError, ValueError):
    """A checkpoint whose optimizer state this worker's layout cannot load."""


class BackgroundWrites:
    """Files written by one thread while training goes on; :meth:`finish` raises a write's error."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hf-copy")
        self._pending: list[Future] = []

    def submit(self, write, *args) -> None:
        self._pending.append(self._pool.submit(write, *args))

    def finish(self, blocking: bool) -> bool:
        """Whether every write is done (waiting for them when ``blocking``)."""
        if blocking:
            wait(self._pending)
        finished: list[Future] = []
        pending: list[Future] = []
        for future in self._pending:  # one look at each: a write ending now is in one list, not both
            (finished if future.done() else pending).append(future)
        self._pending = pending
        for future in finished:
            future.result()
        return not pending


def _sharded_state(worker: CheckpointedWorker, is_loading: bool, optimizer_format: str) -> dict:
    """Model chunks (tensor keys use model-wide layer indices, so any PP / virtual-stage layout
    loads any other), the optimizer over all of them, and the step counter."""
    chunk_states = {f"model{i}": model.sharded_state_dict() for i, model in enumerate(worker.models)}
    model_state = chunk_states["model0"] if len(chunk_states) == 1 else chunk_states
    init_fallback_adam_state(worker.optimizer)  # a load template, or a save before the first step
    optimizer_state = worker.optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata={FORMAT_KEY: optimizer_format}
    )
    return {"model": model_state, "optimizer": optimizer_state, "steps_done": worker.steps_done}


def _content_metadata(worker: CheckpointedWorker) -> dict:
    """The optimizer's format (a plain optimizer's state is per parameter: it reshards freely)."""
    layout = worker.layout
    return {
        FORMAT_KEY: layout.optimizer_checkpoint if layout.use_distributed_optimizer else "fully_reshardable",
        "layout": {name: getattr(layout, name) for name in BUCKET_LAYOUT},
    }


def _loadable_format(worker: CheckpointedWorker, metadata: dict | None, path: str) -> str:
    """The optimizer format of the checkpoint at ``path``; raises when this layout cannot load it.

    Checkpoints written before the format was recorded are ``fully_reshardable``."""
    if not metadata:
        return "fully_reshardable"
    saved, here = metadata["layout"], _content_metadata(worker)["layout"]
    differ = {name: (saved[name], here[name]) for name in BUCKET_LAYOUT if saved[name] != here[name]}
    if metadata[FORMAT_KEY] == "dp_reshardable" and differ:
        changes = ", ".join(f"actor.megatron.{name} {old} -> {new}" for name, (old, new) in differ.items())
        raise CheckpointLayoutError(
            f"{path}: its optimizer state was saved with actor.megatron.optimizer_checkpoint=dp_reshardable, "
            f"which loads only at the layout it was saved at, and this run changes {changes}. Resume at the "
            "saved layout (the DP size may differ); to change the layout, resume there once with "
            "actor.megatron.optimizer_checkpoint=fully_reshardable, save, then load that checkpoint."
        )
    return metadata[FORMAT_KEY]


def save_checkpoint(worker: CheckpointedWorker, path: str, asynchronous: bool = False) -> None:
    """Collective. With ``asynchronous`` the sharded state is still being written on return."""
    from megatron.core import dist_checkpointing

    weights_dir = os.path.join(path, "megatron")
    if worker.rank == 0:
        os.makedirs(weights_dir, exist_ok=True)
    dist.barrier()
    worker.gather_params()
    request = dist_checkpointing.save(
        _sharded_state(worker, is_loading=False, optimizer_format=worker.layout.optimizer_checkpoint),
        weights_dir,
        async_sharded_save=asynchronous,
        content_metadata=_content_metadata(worker),
    )
    if asynchronous:
        worker.async_saves.schedule_async_request(request)
    torch.save(rng_state(), os.path.join(path, f"rng_rank{worker.rank}.pt"))
    _save_hf_weights(worker, os.path.join(path, "model"), asynchronous)
    dist.barrier()


def _save_hf_weights(worker: CheckpointedWorker, folder: str, asynchronous: bool) -> None:
    """A Hugging Face copy of the weights beside the sharded state, for export and serving (collective).

    Each pipeline stage's exporting rank writes its own safetensors shard (never the whole model on
    one rank); rank 0 writes the index, as ``save_pretrained`` does for a sharded model. The
    weights are copied to host memory first (no second copy of a stage on its GPU; a tied lm_head
    gets storage of its own, which safetensors needs), so an asynchronous save writes the shard
    from a thread while the next update changes the weights.
    """
    from safetensors.torch import save_file

    weights = {
        name: tensor.detach().to("cpu", copy=True).contiguous()
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
        shard = os.path.join(folder, files[exporters.index(worker.rank)])
        if asynchronous:
            worker.background_writes.submit(save_file, weights, shard)
        else:
            save_file(weights, shard)
    if worker.rank == 0:
        worker.hf_config.save_pretrained(folder)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(sum(s.values()) for s in shards)},
                "weight_map": {name: file for file, names in zip(files, shards) for name in names},
            }
            with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
                json.dump(index, handle, indent=2)


def finish_async_saves(worker: CheckpointedWorker, blocking: bool) -> bool:
    """Collective: whether this rank's background writes are done (the sharded state's finalised:
    metadata written, errors raised on all ranks; the HF copy's errors raised here); ``blocking``
    waits for them."""
    worker.async_saves.maybe_finalize_async_calls(blocking=blocking)
    hf_copy_done = worker.background_writes.finish(blocking)
    return worker.async_saves.get_num_unfinalized_calls() == 0 and hf_copy_done


def load_checkpoint(worker: CheckpointedWorker, path: str) -> None:
    from megatron.core import dist_checkpointing

    # torch and megatron-core read a checked private copy: nothing the folder holds runs code
    with checked_distributed_checkpoint(os.path.join(path, "megatron")) as weights_dir:
        optimizer_format = _loadable_format(worker, dist_checkpointing.load_content_metadata(weights_dir), path)
        loaded = dist_checkpointing.load(
            _sharded_state(worker, is_loading=True, optimizer_format=optimizer_format), weights_dir
        )
    model_state = loaded["model"]
    for i, model in enumerate(worker.models):
        model.load_state_dict(model_state if len(worker.models) == 1 else model_state[f"model{i}"])
    skip_step_when_restoring_adam_state()
    # megatron-core 0.16 restores a dp_reshardable state with grad mode on; with fp32 weights the
    # main parameters are views of the weights, and copying into them then fails
    with torch.no_grad():
        worker.optimizer.load_state_dict(loaded["optimizer"])
    unshare_adam_steps(worker.optimizer)
    worker.steps_done = int(loaded["steps_done"])
    rng_file = os.path.join(path, f"rng_rank{worker.rank}.pt")
    if os.path.exists(rng_file):
        restore_rng(load_state(rng_file))
