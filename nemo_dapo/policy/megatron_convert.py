"""Hugging Face Qwen2 / Llama weights <-> Megatron-core GPTModel parameters (local layer spec).

Three steps, each invertible and exact (only copies, concatenations and slices):

1. rename + fuse: HF ``q/k/v_proj`` become one ``linear_qkv`` in Megatron's per-query-group
   layout ``[q_0..q_{n-1}, k, v]`` for every KV group; ``gate_proj`` / ``up_proj`` become the
   SwiGLU ``linear_fc1`` = ``[gate; up]``;
2. pipeline slicing: a stage holds a contiguous range of layers, renumbered from 0;
3. tensor-parallel sharding: column-parallel weights split along dim 0 (whole KV groups for
   ``linear_qkv``, gate and up halves separately for ``linear_fc1``), row-parallel along dim 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """What the layout of the fused tensors depends on."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   config.vocab_size, bool(getattr(config, "tie_word_embeddings", False)))


GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
MEGATRON_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """[q; k; v] (weights or biases) -> per-KV-group interleaved ``linear_qkv``."""
    groups, per_group = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * shape.head_dim, *rest)
    k = k.reshape(groups, shape.head_dim, *rest)
    v = v.reshape(groups, shape.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    groups, per_group = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * shape.head_dim, *rest)
    q, k, v = grouped.split([per_group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


def _hf_layer_to_megatron(layer: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    out = {LAYER_RENAMES[k]: v for k, v in layer.items() if k in LAYER_RENAMES}
    attn = "self_attn.{}_proj.{}"
    out["self_attention.linear_qkv.weight"] = fuse_qkv(*(layer[attn.format(p, "weight")] for p in "qkv"), shape)
    if attn.format("q", "bias") in layer:
        out["self_attention.linear_qkv.bias"] = fuse_qkv(*(layer[attn.format(p, "bias")] for p in "qkv"), shape)
    out["mlp.linear_fc1.weight"] = torch.cat([layer["mlp.gate_proj.weight"], layer["mlp.up_proj.weight"]])
    return out


def _megatron_layer_to_hf(layer: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    inverse = {v: k for k, v in LAYER_RENAMES.items()}
    out = {inverse[k]: v for k, v in layer.items() if k in inverse}
    for kind in ("weight", "bias"):
        fused = layer.get(f"self_attention.linear_qkv.{kind}")
        if fused is not None:
            for proj, part in zip("qkv", split_qkv(fused, shape)):
                out[f"self_attn.{proj}_proj.{kind}"] = part
    gate, up = layer["mlp.linear_fc1.weight"].chunk(2)
    out["mlp.gate_proj.weight"], out["mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
    return out


def _by_layer(state: dict[str, torch.Tensor], pattern: re.Pattern) -> tuple[dict[int, dict], dict[str, torch.Tensor]]:
    layers: dict[int, dict[str, torch.Tensor]] = {}
    other = {}
    for name, tensor in state.items():
        match = pattern.fullmatch(name)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        else:
            other[name] = tensor
    return layers, other


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Full (unsharded, single-stage) GPTModel state from an HF state dict."""
    layers, other = _by_layer(hf, HF_LAYER)
    out = {GLOBAL_RENAMES[k]: v for k, v in other.items() if k in GLOBAL_RENAMES}
    if shape.tied_embeddings:
        out.pop("output_layer.weight", None)
    for index, layer in layers.items():
        out.update({f"decoder.layers.{index}.{k}": v for k, v in _hf_layer_to_megatron(layer, shape).items()})
    return out


def megatron_to_hf(megatron: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron` (HF names in the HF model's order)."""
    layers, other = _by_layer(megatron, MEGATRON_LAYER)
    inverse = {v: k for k, v in GLOBAL_RENAMES.items()}
    out = {"model.embed_tokens.weight": other["embedding.word_embeddings.weight"]}
    for index in sorted(layers):
        out.update({f"model.layers.{index}.{k}": v for k, v in _megatron_layer_to_hf(layers[index], shape).items()})
    out["model.norm.weight"] = other["decoder.final_layernorm.weight"]
    if not shape.tied_embeddings:
        out[inverse["output_layer.weight"]] = other["output_layer.weight"]
    return out


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Global indices of the layers one pipeline stage holds (even split, as Megatron does)."""
    per_stage = num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def stage_state(full: dict[str, torch.Tensor], shape: ModelShape, pp_rank: int, pp_size: int) -> dict[str, torch.Tensor]:
    """The parameters of one pipeline stage, with its layers renumbered from 0.

    The first stage holds the embedding, the last the final norm and the output layer (a copy
    of the embedding when tied and the pipeline has more than one stage, as GPTModel does).
    """
    layers, other = _by_layer(full, MEGATRON_LAYER)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out = {}
    for local, index in enumerate(stage_layers(shape.num_layers, pp_rank, pp_size)):
        out.update({f"decoder.layers.{local}.{k}": v for k, v in layers[index].items()})
    if first:
        out["embedding.word_embeddings.weight"] = other["embedding.word_embeddings.weight"]
    if last:
        out["decoder.final_layernorm.weight"] = other["decoder.final_layernorm.weight"]
        if not shape.tied_embeddings:
            out["output_layer.weight"] = other["output_layer.weight"]
        elif not first:
            out["output_layer.weight"] = other["embedding.word_embeddings.weight"]
    return out


def unstage_state(stages: list[dict[str, torch.Tensor]], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Inverse of :func:`stage_state`: one full state from every stage's (TP-gathered) state."""
    full: dict[str, torch.Tensor] = {}
    pp_size = len(stages)
    for pp_rank, stage in enumerate(stages):
        layers, other = _by_layer(stage, MEGATRON_LAYER)
        for local, index in enumerate(stage_layers(shape.num_layers, pp_rank, pp_size)):
            full.update({f"decoder.layers.{index}.{k}": v for k, v in layers[local].items()})
        if pp_rank == 0:
            full["embedding.word_embeddings.weight"] = other["embedding.word_embeddings.weight"]
        if pp_rank == pp_size - 1:
            full["decoder.final_layernorm.weight"] = other["decoder.final_layernorm.weight"]
            if not shape.tied_embeddings:
                full["output_layer.weight"] = other["output_layer.weight"]
    return full


ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                   "embedding.word_embeddings.weight", "output_layer.weight")


def shard(name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full parameter (KV groups are contiguous, so dim-0 chunks hold whole groups)."""
    if tp_size == 1:
        return tensor
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    if name.endswith(COLUMN_PARALLEL):
        return tensor.chunk(tp_size)[tp_rank].contiguous()
    if name.endswith(ROW_PARALLEL):
        return tensor.chunk(tp_size, dim=1)[tp_rank].contiguous()
    return tensor


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard` from every TP rank's slice, in rank order."""
    if len(shards) == 1:
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]
        return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
    if name.endswith(COLUMN_PARALLEL):
        return torch.cat(shards)
    if name.endswith(ROW_PARALLEL):
        return torch.cat(shards, dim=1)
    return shards[0]


def pad_vocab(tensor: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """Zero rows so the vocabulary divides evenly over TP ranks (sliced off again on export)."""
    if tensor.shape[0] == padded_vocab:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(padded_vocab - tensor.shape[0], *tensor.shape[1:])])
