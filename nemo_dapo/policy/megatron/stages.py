"""What the pipeline stages and ranks of a Megatron replica must agree on: only the last stage
sees logits and the loss, so its results are sent to the others; a step is skipped only when
every rank skips it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_dapo.config.topology import Parallelism


def from_last_stage(tensor: torch.Tensor, parallel: Parallelism, device: torch.device) -> torch.Tensor:
    """The last pipeline stage's ``tensor``, on every stage (collective over the pipeline group)."""
    from megatron.core import parallel_state

    if parallel.pipeline == 1:
        return tensor
    group = parallel_state.get_pipeline_model_parallel_group()
    on_device = tensor.to(device)  # NCCL broadcasts device tensors only
    dist.broadcast(on_device, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
    return on_device.cpu()


def share_metrics(step_metrics: dict[str, list[float]], parallel: Parallelism) -> dict[str, list[float]]:
    """Loss metrics exist on the last pipeline stage only; give every stage the same values."""
    from megatron.core import parallel_state

    if parallel.pipeline == 1:
        return step_metrics
    shared = [step_metrics]
    dist.broadcast_object_list(
        shared,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return shared[0]


def gradients_finite(chunks: list, device: torch.device) -> bool:
    """Whether every rank's reduced gradients are finite, agreed by all ranks (one flag reduced
    over the world): in bf16 and fp32 no loss scaler skips an Inf/NaN step, so the worker does,
    as the torch worker does."""
    bad = torch.zeros(1, device=device)
    for chunk in chunks:
        grads = (getattr(p, "main_grad", p.grad) for p in chunk.parameters() if p.requires_grad)
        if any(g is not None and not torch.isfinite(g).all() for g in grads):
            bad.fill_(1.0)
            break
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0
