"""Transformer shapes for capacity planning: a table of known models, or a local config.json.

The hub is often unreachable from where a job is planned (a login node, this CI), so the
production models are listed here; any other model is read from its Hugging Face folder.
Parameter counts follow the Qwen2 / Qwen3 / Llama decoder: GQA attention, SwiGLU MLP or
routed SwiGLU experts, RMSNorm, untied (or tied) embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

QK_NORM_MODELS = ("qwen3", "qwen3_moe")  # RMSNorm on each head's queries and keys


@dataclass(frozen=True)
class Architecture:
    """A decoder's shape: the one model-shape type, read by the planner (parameter and memory
    counts), the start-up checks and the Megatron backend (the layout of its fused tensors)."""

    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense SwiGLU width (unused when every layer is a MoE layer)
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 / Qwen2.5
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's queries and keys
    num_experts: int = 0  # 0 = dense
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    max_positions: int | None = None  # config.json's max_position_embeddings: the longest sequence it takes

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attention_params(self) -> int:
        """Q, K, V, O projections (+ QKV bias, + per-head q/k norms) of one layer."""
        h = self.hidden_size
        params = h * (self.q_width + 2 * self.kv_width) + self.q_width * h
        if self.qkv_bias:
            params += self.q_width + 2 * self.kv_width
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    def mlp_params(self) -> int:
        """Dense SwiGLU (gate, up, down) of one layer; 0 for MoE layers."""
        return 0 if self.is_moe else 3 * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        """All routed experts of one layer (each a SwiGLU of width moe_intermediate_size)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    def norm_params(self) -> int:
        """The two RMSNorms of one layer."""
        return 2 * self.hidden_size

    def layer_params(self) -> int:
        return (
            self.attention_params()
            + self.mlp_params()
            + self.expert_params()
            + self.router_params()
            + self.norm_params()
        )

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def output_params(self) -> int:
        """Final norm + LM head (the head is the embedding when tied)."""
        return self.hidden_size + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    def total_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params() + self.output_params()


KNOWN_ARCHITECTURES = {
    # config.json of Qwen/Qwen2.5-32B: 32,763,876,352 parameters
    "qwen2.5-32b": Architecture(
        name="Qwen2.5-32B",
        hidden_size=5120,
        num_layers=64,
        num_attention_heads=40,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=27648,
        vocab_size=152064,
        qkv_bias=True,
        max_positions=131072,
    ),
    # config.json of Qwen/Qwen2.5-7B: 7.6 B parameters (rung 1 of the 32B bring-up ladder)
    "qwen2.5-7b": Architecture(
        name="Qwen2.5-7B",
        hidden_size=3584,
        num_layers=28,
        num_attention_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
        qkv_bias=True,
        max_positions=131072,
    ),
    # config.json of Qwen/Qwen3-8B-Base: 8.2 B parameters (rung 1 of the 30B-A3B bring-up ladder)
    "qwen3-8b": Architecture(
        name="Qwen3-8B",
        hidden_size=4096,
        num_layers=36,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        qk_norm=True,
        max_positions=32768,
    ),
    # config.json of Qwen/Qwen3-30B-A3B(-Base): 30.5 B parameters, 3.3 B active
    "qwen3-30b-a3b": Architecture(
        name="Qwen3-30B-A3B",
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        qk_norm=True,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=768,
        max_positions=40960,
    ),
}


def from_hf_config(raw: dict, name: str) -> Architecture:
    """Shape from a Hugging Face ``config.json`` (text part of multimodal configs)."""
    raw = raw.get("text_config", raw)
    heads = raw["num_attention_heads"]
    model_type = raw.get("model_type", "")
    return Architecture(
        name=name,
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw.get("intermediate_size", 0),
        vocab_size=raw["vocab_size"],
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", model_type.startswith("qwen2"))),
        qk_norm=model_type in QK_NORM_MODELS,
        num_experts=raw.get("num_experts") or raw.get("num_local_experts") or 0,
        experts_per_token=raw.get("num_experts_per_tok", 0),
        moe_intermediate_size=raw.get("moe_intermediate_size") or raw.get("intermediate_size", 0),
        max_positions=raw.get("max_position_embeddings"),
    )


def _known(model_path: str) -> Architecture | None:
    """Match the folder or hub name (``Qwen/Qwen2.5-32B-Instruct`` -> ``qwen2.5-32b``)."""
    base = Path(model_path.rstrip("/")).name.lower()
    for key in sorted(KNOWN_ARCHITECTURES, key=len, reverse=True):
        if base == key or base.startswith(key + "-"):  # qwen2.5-7b-instruct, never qwen2.5-72b
            return KNOWN_ARCHITECTURES[key]
    return None


def resolve_architecture(model_path: str) -> Architecture:
    """A local folder's config.json wins; otherwise the known table by name."""
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        return from_hf_config(json.loads(config_file.read_text()), Path(model_path).name)
    known = _known(model_path)
    if known is None:
        raise ValueError(
            f"model.path={model_path!r}: no config.json there and not a known architecture "
            f"({sorted(KNOWN_ARCHITECTURES)}); point model.path at a local Hugging Face folder"
        )
    return known
