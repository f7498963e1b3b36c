"""Save / load a Megatron policy worker with ``dist_checkpointing`` (torch_dist format).

The model and the distributed optimizer are saved as sharded tensors in a layout-independent
form (optimizer sharding type ``fully_reshardable``), so a checkpoint written at one TP / PP /
DP layout loads at another. The step counter goes into the common state; RNG states are per
rank, beside the checkpoint (absent ranks keep theirs, as in the torch worker). A gathered
Hugging Face copy of the weights (``model/``) is written too, as by the torch worker.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

from nemo_dapo.policy.megatron_cpu_compat import (init_fallback_adam_state, skip_step_when_restoring_adam_state,
                                                   unshare_adam_steps)

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state(worker, is_loading: bool) -> dict:
    model_state = worker.model.module.sharded_state_dict()
    if is_loading:
        init_fallback_adam_state(worker.optimizer)
    optimizer_state = worker.optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                          metadata=OPTIMIZER_METADATA)
    return {"model": model_state, "optimizer": optimizer_state, "steps_done": worker.steps_done}


def save_checkpoint(worker, path: str) -> None:
    from megatron.core import dist_checkpointing

    weights_dir = os.path.join(path, "megatron")
    if worker.rank == 0:
        os.makedirs(weights_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(worker, is_loading=False), weights_dir)
    torch.save(worker.rng_state(), os.path.join(path, f"rng_rank{worker.rank}.pt"))
    _save_hf_weights(worker, os.path.join(path, "model"))
    dist.barrier()


def _save_hf_weights(worker, folder: str) -> None:
    """A Hugging Face copy of the weights beside the sharded state, for export and serving (collective)."""
    from safetensors.torch import save_file

    weights = {name: tensor for bucket in worker.export_weights(1 << 62) for name, tensor in bucket}
    if worker.rank == 0:
        os.makedirs(folder, exist_ok=True)
        save_file({name: tensor.detach().contiguous().clone() for name, tensor in weights.items()},
                  os.path.join(folder, "model.safetensors"))
        worker.hf_config.save_pretrained(folder)


def load_checkpoint(worker, path: str) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded_state(worker, is_loading=True), os.path.join(path, "megatron"))
    worker.model.module.load_state_dict(loaded["model"])
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
