"""A Megatron rank's model and optimizer, built from an HF folder: the GPTModel chunks with this
rank's share of the weights, Megatron's DDP around them (gradient buffers, overlapped reduction)
and the (distributed) Adam optimizer. Used once, by the worker's constructor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_dapo.config.architecture import Architecture
from nemo_dapo.config.schema_actor import MegatronConfig, OptimConfig
from nemo_dapo.config.topology import Parallelism
from nemo_dapo.policy.megatron import model as mm
from nemo_dapo.policy.megatron.vocab import DeferredOutputLayer


@dataclass
class BuiltChunks:
    models: list  # GPTModel chunks: one, or ``virtual`` interleaved ones
    output: DeferredOutputLayer | None  # on the last pipeline stage only


def build_chunks(
    model_path: str, hf_config, config, shape: Architecture, layout: MegatronConfig, device: torch.device
) -> BuiltChunks:
    """This rank's GPTModel chunks with the checkpoint's weights (each chunk reads and converts
    only its own share of the checkpoint)."""
    parallel = Parallelism.of(layout)
    models, output = [], None
    for vp_stage in range(parallel.chunks_per_rank):
        full = mm.full_megatron_state(
            mm.read_hf_weights(model_path, mm.chunk_needs(shape, vp_stage)), shape, parallel.tensor
        )
        model = mm.build_gpt_model(hf_config, config, layout.transformer_impl, vp_stage if parallel.virtual else None)
        # as Megatron's get_model + Float16Module: every parameter on this rank's device, in the
        # training dtype (the torch-norm fallback of the local spec is built on the CPU in fp32)
        model.to(device=device, dtype=config.params_dtype)
        mm.load_local_weights(model, mm.local_weights(full, shape, parallel.tensor, vp_stage))
        if getattr(model, "output_layer", None) is not None:  # the last stage's last chunk
            output = DeferredOutputLayer(model.output_layer)
        models.append(model)
    return BuiltChunks(models, output)


def wrap_for_training(models: list, config, layout: MegatronConfig) -> list:
    """Each chunk in Megatron's DDP (gradient buffers; as Megatron's training loop, only the first
    chunk's gradient reduction is bucketed), with the schedule's hooks for overlapped reduction."""
    from megatron.core.distributed import DistributedDataParallel

    ddp_config = mm.ddp_config(layout)
    chunks = [
        DistributedDataParallel(config, ddp_config, model, disable_bucketing=vp_stage > 0)
        for vp_stage, model in enumerate(models)
    ]
    if layout.overlap_grad_reduce:
        install_overlap_hooks(config, chunks)
    return chunks


def install_overlap_hooks(config, chunks: list) -> None:
    """As Megatron's training loop: no gradient reduction before the last micro-batch, then each
    chunk's reduction started as soon as its backward ends. Overlapped parameter gathers need
    none: DDP's forward pre-hooks run them."""

    def per_chunk(method: str):
        methods = [getattr(chunk, method) for chunk in chunks]
        return methods[0] if len(methods) == 1 else methods

    config.no_sync_func = per_chunk("no_sync")
    config.grad_sync_func = per_chunk("start_grad_sync")


def build_optimizer(chunks: list, optim: OptimConfig, layout: MegatronConfig, config):
    """Megatron's Adam (AdamW's decoupled weight decay) with the torch worker's settings."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    settings = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        use_distributed_optimizer=layout.use_distributed_optimizer,
        params_dtype=config.params_dtype,
        bf16=config.bf16,
        fp16=config.fp16,
    )
    # config_overrides={}: weight decay on every parameter, as torch.optim.AdamW in the torch worker
    return get_megatron_optimizer(settings, chunks, config_overrides={})
