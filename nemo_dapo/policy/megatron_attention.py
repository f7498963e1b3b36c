"""Core attention for Megatron's local layer spec on torch's ``scaled_dot_product_attention``.

Megatron's own local ``DotProductAttention`` materialises the [b, heads, s, s] scores and
probabilities for the backward (tens of GiB per micro-batch of long rows on a GPU) and refuses
packed sequences. This module is its drop-in replacement in the local spec: torch picks a fused
kernel (flash / memory-efficient on a GPU, the flash CPU kernel on a CPU), grouped-query heads
are not repeated, and packed rows (THD, ``cu_seqlens``) are attended one row at a time. The
TransformerEngine spec keeps TE's attention.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule


def _segments(packed_seq_params) -> list[tuple[int, int]]:
    cu_seqlens = packed_seq_params.cu_seqlens_q.tolist()
    return list(zip(cu_seqlens[:-1], cu_seqlens[1:]))


class SdpaAttention(MegatronModule):
    """``core_attention`` of the local spec: same inputs and outputs as Megatron's
    ``DotProductAttention`` (queries [sq, b, heads, d], keys / values [sk, b, groups, d] or
    THD [t, heads, d]; output [sq, b, heads * d])."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs transformer_impl='transformer_engine'")
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the SDPA core attention")
        if packed_seq_params is not None:
            return torch.cat([self._attend(query[start:end, None], key[start:end, None],
                                           value[start:end, None], None)[:, 0]
                              for start, end in _segments(packed_seq_params)])
        return self._attend(query, key, value, attention_mask)

    def _attend(self, query, key, value, blocked):
        """[s, b, h, d] in, [s, b, h * d] out; ``blocked`` is Megatron's mask (True = masked) or
        None for plain causal attention."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None
        if blocked is not None:
            # a query that may see nothing (left padding) sees itself: softmax over an empty row
            # would be NaN, and NaN values poison every query through the zero weights
            allowed = ~blocked | torch.eye(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        with self._dropout_rng():
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, is_causal=blocked is None,
                dropout_p=self.dropout if self.training else 0.0, scale=self.scale,
                enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3).flatten(2)

    def _dropout_rng(self):
        """As Megatron: dropout inside the TP region draws from the model-parallel RNG."""
        if self.dropout and self.training and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()
