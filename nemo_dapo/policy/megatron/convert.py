"""Hugging Face Qwen2 / Qwen3 / Llama / Qwen3-MoE weights <-> Megatron-core GPTModel parameters.

Four steps, each invertible and exact (only copies, concatenations and slices):

1. rename + fuse: HF ``q/k/v_proj`` become one ``linear_qkv`` in Megatron's per-query-group
   layout ``[q_0..q_{n-1}, k, v]`` for every KV group; ``gate_proj`` / ``up_proj`` become the
   SwiGLU ``linear_fc1`` = ``[gate; up]`` (of the dense MLP, or of each expert
   ``mlp.experts.local_experts.j``: in the full model state ``j`` is the global expert index);
2. pipeline slicing: a stage holds a contiguous range of layers, renumbered from 0;
3. expert-parallel slicing: EP rank ``r`` holds experts ``[r E / ep, (r + 1) E / ep)``,
   renumbered from 0 (its *local* experts);
4. tensor-parallel sharding: column-parallel weights split along dim 0 (whole KV groups for
   ``linear_qkv``, gate and up halves separately for ``linear_fc1``), row-parallel along dim 1;
   experts are sharded the same way over the expert-TP group; routers and norms are replicated.
"""

from __future__ import annotations

import re

import torch

from nemo_dapo.config.architecture import Architecture, from_hf_config

MOE_MODELS = ("qwen3_moe",)


def model_shape(config) -> Architecture:
    """The shape of a transformers config, once its MoE layout is one we convert (:func:`routed_experts`)."""
    routed_experts(config)
    return from_hf_config(config.to_dict(), config.model_type)


def routed_experts(config) -> int:
    """The number of routed experts (0 for a dense model); ValueError for MoE layouts we cannot convert.

    Only Qwen3-MoE with every layer sparse is supported: other MoE families have shared experts
    or other router names, and dense layers mixed in would need a second layer spec.
    """
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    if not experts:
        return 0
    if config.model_type not in MOE_MODELS:
        raise ValueError(
            f"model_type={config.model_type!r}: mixture-of-experts models are supported for {MOE_MODELS} only"
        )
    dense_layers = list(getattr(config, "mlp_only_layers", None) or [])
    if getattr(config, "decoder_sparse_step", 1) != 1 or dense_layers:
        raise ValueError(
            f"decoder_sparse_step={config.decoder_sparse_step}, mlp_only_layers={dense_layers}: "
            "dense MLP layers between MoE layers are not supported (every layer must be sparse: "
            "decoder_sparse_step=1, mlp_only_layers=[])"
        )
    return int(experts)


GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
LAYER_RENAMES = {  # the last three exist only in Qwen3 (q/k norms) and MoE (router) layers
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
}
HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
MEGATRON_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
EXPERT = re.compile(r"(.*\bmlp\.experts\.local_experts\.)(\d+)(\..+)")
HF_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\..+")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Architecture) -> torch.Tensor:
    """[q; k; v] (weights or biases) -> per-KV-group interleaved ``linear_qkv``."""
    groups, per_group = shape.num_kv_heads, shape.num_attention_heads // shape.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * shape.head_dim, *rest)
    k = k.reshape(groups, shape.head_dim, *rest)
    v = v.reshape(groups, shape.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    groups, per_group = shape.num_kv_heads, shape.num_attention_heads // shape.num_kv_heads
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * shape.head_dim, *rest)
    q, k, v = grouped.split([per_group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


def swiglu_prefixes(shape: Architecture) -> list[tuple[str, str]]:
    """(HF, Megatron) name prefixes of a layer's SwiGLU MLPs: the dense one, or every expert (global index)."""
    if not shape.num_experts:
        return [("mlp.", "mlp.")]
    return [(f"mlp.experts.{j}.", f"mlp.experts.local_experts.{j}.") for j in range(shape.num_experts)]


def _hf_swiglu_to_megatron(layer: dict[str, torch.Tensor], hf: str, megatron: str) -> dict[str, torch.Tensor]:
    fc1 = torch.cat([layer[f"{hf}gate_proj.weight"], layer[f"{hf}up_proj.weight"]])
    return {f"{megatron}linear_fc1.weight": fc1, f"{megatron}linear_fc2.weight": layer[f"{hf}down_proj.weight"]}


def _megatron_swiglu_to_hf(layer: dict[str, torch.Tensor], hf: str, megatron: str) -> dict[str, torch.Tensor]:
    gate, up = layer[f"{megatron}linear_fc1.weight"].chunk(2)
    return {
        f"{hf}gate_proj.weight": gate.contiguous(),
        f"{hf}up_proj.weight": up.contiguous(),
        f"{hf}down_proj.weight": layer[f"{megatron}linear_fc2.weight"],
    }


def _hf_layer_to_megatron(layer: dict[str, torch.Tensor], shape: Architecture) -> dict[str, torch.Tensor]:
    out = {LAYER_RENAMES[k]: v for k, v in layer.items() if k in LAYER_RENAMES}
    attn = "self_attn.{}_proj.{}"
    for kind in ("weight", "bias"):
        if attn.format("q", kind) in layer:
            q, k, v = (layer[attn.format(p, kind)] for p in "qkv")
            out[f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, shape)
    for hf, megatron in swiglu_prefixes(shape):
        # an EP rank reads only its own experts (a missing one is caught when the model is loaded)
        if not shape.num_experts or f"{hf}down_proj.weight" in layer:
            out.update(_hf_swiglu_to_megatron(layer, hf, megatron))
    return out


def _megatron_layer_to_hf(layer: dict[str, torch.Tensor], shape: Architecture) -> dict[str, torch.Tensor]:
    inverse = {v: k for k, v in LAYER_RENAMES.items()}
    out = {inverse[k]: v for k, v in layer.items() if k in inverse}
    for kind in ("weight", "bias"):
        fused = layer.get(f"self_attention.linear_qkv.{kind}")
        if fused is not None:
            for proj, part in zip("qkv", split_qkv(fused, shape)):
                out[f"self_attn.{proj}_proj.{kind}"] = part
    for hf, megatron in swiglu_prefixes(shape):
        out.update(_megatron_swiglu_to_hf(layer, hf, megatron))
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


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: Architecture) -> dict[str, torch.Tensor]:
    """Full (unsharded, single-stage) GPTModel state from an HF state dict."""
    layers, other = _by_layer(hf, HF_LAYER)
    out = {GLOBAL_RENAMES[k]: v for k, v in other.items() if k in GLOBAL_RENAMES}
    if shape.tie_word_embeddings:
        out.pop("output_layer.weight", None)
    for index, layer in layers.items():
        out.update({f"decoder.layers.{index}.{k}": v for k, v in _hf_layer_to_megatron(layer, shape).items()})
    return out


def megatron_to_hf(megatron: dict[str, torch.Tensor], shape: Architecture) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron` (HF names in the HF model's order).

    Also converts a part of the model (some layers, with or without the embedding / final norm /
    output layer): the streaming exporter converts one layer at a time.
    """
    layers, other = _by_layer(megatron, MEGATRON_LAYER)
    inverse = {v: k for k, v in GLOBAL_RENAMES.items()}
    out = {}
    if "embedding.word_embeddings.weight" in other:
        out["model.embed_tokens.weight"] = other["embedding.word_embeddings.weight"]
    for index in sorted(layers):
        out.update({f"model.layers.{index}.{k}": v for k, v in _megatron_layer_to_hf(layers[index], shape).items()})
    if "decoder.final_layernorm.weight" in other:
        out["model.norm.weight"] = other["decoder.final_layernorm.weight"]
    if "output_layer.weight" in other and not shape.tie_word_embeddings:
        out[inverse["output_layer.weight"]] = other["output_layer.weight"]
    return out


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Global indices of the layers one pipeline stage holds (even split, as Megatron does)."""
    per_stage = num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def hf_name_needed(
    name: str, shape: Architecture, layers: range, first: bool, last: bool, ep_rank: int, ep_size: int
) -> bool:
    """Whether a model chunk holding ``layers`` (first / last of the pipeline) on EP rank
    ``ep_rank`` needs the HF tensor ``name``: its layers (of those, only its own experts), the
    embedding on the first chunk (and on the last when tied), the final norm and head on the last."""
    layer = HF_LAYER.fullmatch(name)
    if layer:
        expert = HF_EXPERT.fullmatch(name)
        mine = expert is None or int(expert.group(1)) // (shape.num_experts // ep_size) == ep_rank
        return int(layer.group(1)) in layers and mine
    target = GLOBAL_RENAMES.get(name)
    if target == "embedding.word_embeddings.weight":
        return first or (last and shape.tie_word_embeddings)
    return target is not None and last


def stage_state(
    full: dict[str, torch.Tensor], shape: Architecture, pp_rank: int, pp_size: int
) -> dict[str, torch.Tensor]:
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
        if not shape.tie_word_embeddings:
            out["output_layer.weight"] = other["output_layer.weight"]
        elif not first:
            out["output_layer.weight"] = other["embedding.word_embeddings.weight"]
    return out


def unstage_state(stages: list[dict[str, torch.Tensor]], shape: Architecture) -> dict[str, torch.Tensor]:
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
            if not shape.tie_word_embeddings:
                full["output_layer.weight"] = other["output_layer.weight"]
    return full


def is_expert(name: str) -> bool:
    return EXPERT.fullmatch(name) is not None


def global_expert_name(name: str, ep_rank: int, experts_per_rank: int) -> str:
    """A local expert's parameter name under its global expert index (any other name unchanged)."""
    match = EXPERT.fullmatch(name)
    if match is None:
        return name
    return f"{match.group(1)}{ep_rank * experts_per_rank + int(match.group(2))}{match.group(3)}"


def slice_experts(
    state: dict[str, torch.Tensor], shape: Architecture, ep_rank: int, ep_size: int
) -> dict[str, torch.Tensor]:
    """EP rank ``ep_rank``'s parameters: its experts renumbered from 0, every other parameter as is."""
    per_rank = shape.num_experts // ep_size
    out = {}
    for name, tensor in state.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
        elif int(match.group(2)) // per_rank == ep_rank:
            out[f"{match.group(1)}{int(match.group(2)) % per_rank}{match.group(3)}"] = tensor
    return out


def unslice_experts(slices: list[dict[str, torch.Tensor]], shape: Architecture) -> dict[str, torch.Tensor]:
    """Inverse of :func:`slice_experts` from every EP rank's state, in rank order."""
    per_rank = shape.num_experts // len(slices)
    full = {k: v for k, v in slices[0].items() if not is_expert(k)}  # replicated over EP
    for ep_rank, part in enumerate(slices):
        full.update({global_expert_name(k, ep_rank, per_rank): v for k, v in part.items() if is_expert(k)})
    return full


ROW_PARALLEL = ("self_attention.linear_proj.weight", ".linear_fc2.weight")  # dense MLP and experts
COLUMN_PARALLEL = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "embedding.word_embeddings.weight",
    "output_layer.weight",
)


def shard(name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full parameter (KV groups are contiguous, so dim-0 chunks hold whole groups)."""
    if tp_size == 1:
        return tensor
    if name.endswith(".linear_fc1.weight"):
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
    if name.endswith(".linear_fc1.weight"):
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
