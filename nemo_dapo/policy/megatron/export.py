"""Stream a Megatron model's weights out as HF-named tensors, one layer at a time.

No rank ever holds more than one layer of gathered weights: each pipeline stage exports its own
layers, a parameter is gathered over its tensor-parallel group (experts also over the expert-
parallel group) when its layer is reached, the layer is converted to HF names and handed on, and
the gathered copies are dropped. Exactly one rank per stage yields tensors (the *exporter*: first
tensor-parallel rank of the first data-parallel replica); the ranks it gathers from take part and
yield nothing; other replicas hold copies and only join the expert gathers of their EP group.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nemo_dapo.config.architecture import Architecture
from nemo_dapo.policy.megatron import convert as convert
from nemo_dapo.policy.megatron import model as mm


def is_exporter() -> bool:
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    )


def _global_name(name: str, layer_offset: int) -> str:
    """Stage-local ``decoder.layers.i`` -> the model-wide layer index."""
    match = convert.MEGATRON_LAYER.fullmatch(name)
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}" if match else name


def _to_hf(part: dict[str, torch.Tensor], shape: Architecture) -> dict[str, torch.Tensor]:
    part = {k: v[: shape.vocab_size] if k in mm.VOCAB_ROWS else v for k, v in mm.to_local_names(part).items()}
    hf = convert.megatron_to_hf(part, shape)
    if shape.tie_word_embeddings and "model.embed_tokens.weight" in hf:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]  # the torch worker's state dict has it too
    return hf


def _stage_parts(model: torch.nn.Module, shape: Architecture, vp_stage: int) -> Iterator[dict[str, torch.Tensor]]:
    """Gathered Megatron-named parameters of one chunk, one layer (or one global tensor) at a time."""
    chunk, chunks = mm.chunk_index(vp_stage), mm.num_chunks()
    offset = convert.stage_layers(shape.num_layers, chunk, chunks).start
    last_stage_copy = shape.tie_word_embeddings and chunks > 1 and chunk == chunks - 1
    part: dict[str, torch.Tensor] = {}
    current = None
    for name, param in model.named_parameters():
        if last_stage_copy and name == "output_layer.weight":
            continue  # the tied embedding's copy: the first stage exports the original
        if not mm.takes_part_in_gather(name):
            continue
        match = convert.MEGATRON_LAYER.fullmatch(name)
        key = match.group(1) if match else name
        if part and key != current:
            yield part
            part = {}
        current = key
        part.update({_global_name(k, offset): v for k, v in mm.gather_param(name, param, shape).items()})
    if part:
        yield part


def iter_hf_weights(chunks: list[torch.nn.Module], shape: Architecture) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's share of the HF-named weights, chunk by chunk (collective over each stage's TP
    group); the shares of all ranks are the whole model, each tensor exactly once."""
    exporter = is_exporter()
    for vp_stage, model in enumerate(chunks):
        for part in _stage_parts(model, shape, vp_stage):
            if exporter:
                yield from _to_hf(part, shape).items()
