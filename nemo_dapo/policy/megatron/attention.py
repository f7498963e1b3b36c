"""Core attention for Megatron's local layer spec on torch's ``scaled_dot_product_attention``.

Megatron's own local ``DotProductAttention`` materialises the [b, heads, s, s] scores and
probabilities for the backward (tens of GiB per micro-batch of long rows on a GPU) and refuses
packed sequences. This module is its drop-in replacement in the local spec: torch picks a fused
kernel (flash / memory-efficient on a GPU, the flash CPU kernel on a CPU), grouped-query heads
are not repeated, and packed rows (THD, ``cu_seqlens``) are attended one row at a time. The
TransformerEngine spec keeps TE's attention.

With context parallelism (packed rows only) each rank holds two chunks of every row (see
:func:`packing.context_parallel_share`); its queries attend to the whole row's keys and values,
all-gathered over the CP group (the backward reduce-scatters their gradients to their owners).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule


def _segments(packed_seq_params) -> list[tuple[int, int]]:
    cu_seqlens = packed_seq_params.cu_seqlens_q.tolist()
    return list(zip(cu_seqlens[:-1], cu_seqlens[1:]))


def _whole_row(per_rank: tuple[torch.Tensor, ...], local: int, chunk: int) -> torch.Tensor:
    """A row's 2 x CP chunks in order from the CP ranks' local tensors: chunk j is the first of rank
    j's two chunks of the row (at ``local``) for j < CP, else the second of rank 2 x CP - 1 - j's."""
    size = len(per_rank)
    return torch.cat(
        [
            per_rank[j][local : local + chunk]
            if j < size
            else per_rank[2 * size - 1 - j][local + chunk : local + 2 * chunk]
            for j in range(2 * size)
        ]
    )


class SdpaAttention(MegatronModule):
    """``core_attention`` of the local spec: same inputs and outputs as Megatron's
    ``DotProductAttention`` (queries [sq, b, heads, d], keys / values [sk, b, groups, d] or
    THD [t, heads, d]; output [sq, b, heads * d])."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        self.cp_group = parallel_state.get_context_parallel_group() if config.context_parallel_size > 1 else None
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the SDPA core attention")
        if packed_seq_params is not None and self.cp_group is not None:
            return self._attend_context_parallel(query, key, value, _segments(packed_seq_params))
        if packed_seq_params is not None:
            return torch.cat(
                [
                    self._attend(query[start:end, None], key[start:end, None], value[start:end, None])[:, 0]
                    for start, end in _segments(packed_seq_params)
                ]
            )
        if attention_mask is None:
            return self._attend(query, key, value)
        # a query that may see nothing (left padding) sees itself: softmax over an empty row would
        # be NaN, and NaN values poison every query through the zero weights
        sees_itself = torch.eye(query.shape[0], key.shape[0], dtype=torch.bool, device=query.device)
        return self._attend(query, key, value, ~attention_mask | sees_itself)

    def _attend_context_parallel(self, query, key, value, segments: list[tuple[int, int]]):
        """THD on one CP rank: per row, its two local query chunks against the row's gathered keys."""
        assert self.cp_group is not None, "called only with context_parallel_size > 1"
        size, rank = self.cp_group.size(), self.cp_group.rank()
        keys, values = (gather_from_sequence_parallel_region(t, group=self.cp_group).chunk(size) for t in (key, value))
        outputs = []
        for start, end in segments:  # boundaries in the whole pack; this rank holds 1 / CP of each row
            local, chunk = start // size, (end - start) // (2 * size)
            positions = torch.arange(end - start, device=query.device)
            query_positions = torch.cat(
                [
                    positions[rank * chunk : (rank + 1) * chunk],
                    positions[(2 * size - 1 - rank) * chunk : (2 * size - rank) * chunk],
                ]
            )
            causal = query_positions[:, None] >= positions[None, :]
            outputs.append(
                self._attend(
                    query[local : local + 2 * chunk, None],
                    _whole_row(keys, local, chunk)[:, None],
                    _whole_row(values, local, chunk)[:, None],
                    causal,
                )[:, 0]
            )
        return torch.cat(outputs)

    def _attend(self, query, key, value, allowed=None):
        """[s, b, h, d] in, [s, b, h * d] out; ``allowed`` (True = may attend), or None for plain
        causal attention."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        with self._dropout_rng():
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                is_causal=allowed is None,
                dropout_p=self.dropout if self.training else 0.0,
                scale=self.scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        return out.permute(2, 0, 1, 3).flatten(2)

    def _dropout_rng(self):
        """As Megatron: dropout inside the TP region draws from the model-parallel RNG."""
        if self.dropout and self.training and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()
