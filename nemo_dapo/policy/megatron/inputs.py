"""What a Megatron rank feeds its model, as pure functions of a micro-batch and the layout:
the split of a batch into micro-batches (token-budget rows, or packs; a context-parallel rank's
share of each pack), right-padding for sequence parallelism and FP8, the attention mask each
layer spec takes, GPTModel's inputs, and the response tokens' statistics read back from the
model's output, in [rows, response] form whatever the micro-batch's form was.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from nemo_dapo.config.schema_actor import MegatronConfig
from nemo_dapo.config.topology import Parallelism
from nemo_dapo.policy.microbatch import MicroBatch, micro_batches, uniform_micro_batches
from nemo_dapo.policy.packing import (
    context_parallel_share,
    packed_micro_batches,
    response_positions,
    scatter_rows,
    uniform_packs,
)

# (hidden states of the scored positions, their labels) -> (log-probs, entropy), per position
StatsFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def width_multiple(tensor_parallel: int, sequence_parallel: bool, fp8: str | None) -> int:
    """Widths are padded to a multiple of TP with sequence parallelism (it splits the columns over
    TP) and of 16 with FP8 (TransformerEngine's FP8 GEMMs need token counts divisible by 16)."""
    return math.lcm(tensor_parallel if sequence_parallel else 1, 16 if fp8 else 1)


def layout_width_multiple(layout: MegatronConfig, parallel: Parallelism) -> int:
    return width_multiple(parallel.tensor, layout.sequence_parallel, layout.fp8)


def split_batch(
    batch: dict[str, torch.Tensor], layout: MegatronConfig, parallel: Parallelism, max_tokens: int, cp_rank: int
) -> list[MicroBatch]:
    """Token-budget micro-batches (packed ones with ``sequence_packing``); with interleaved stages,
    a multiple of PP of them, all of one shape (Megatron's interleaved schedule runs them in
    groups of PP and sends fixed shapes)."""
    if layout.sequence_packing:
        return packs(batch, layout, parallel, max_tokens, cp_rank)
    if parallel.virtual:
        return uniform_micro_batches(batch, max_tokens, parallel.pipeline)
    return micro_batches(batch, max_tokens)


def packs(
    batch: dict[str, torch.Tensor], layout: MegatronConfig, parallel: Parallelism, max_tokens: int, cp_rank: int
) -> list[MicroBatch]:
    """Packed micro-batches. With context parallelism every row's segment is a multiple of 2 x CP
    (each rank takes two chunks of it) and the pack one of CP x the width multiple; each pack
    says which of its tokens rank ``cp_rank`` holds."""
    cp, multiple = parallel.context, layout_width_multiple(layout, parallel)
    segment, pack_multiple = (1, multiple) if cp == 1 else (2 * cp, math.lcm(2 * cp, cp * multiple))
    if parallel.virtual:
        packed = uniform_packs(batch, max_tokens, pack_multiple, parallel.pipeline, segment)
    else:
        packed = packed_micro_batches(batch, max_tokens, pack_multiple, segment)
    return packed if cp == 1 else [context_parallel_share(pack, cp, cp_rank) for pack in packed]


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask (True = blocked): causal, and padding keys blocked."""
    width = attention_mask.shape[1]
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=attention_mask.device), diagonal=1)
    return causal[None, None] | (attention_mask == 0)[:, None, None, :]


def padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """TransformerEngine's ``padding_causal`` input: [b, 1, 1, s], True = padding (causality is TE's)."""
    return (attention_mask == 0)[:, None, None, :]


def pad_width(micro: MicroBatch, multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model inputs right-padded to a width divisible by ``multiple`` (sequence parallelism splits
    the sequence over the TP ranks); padded columns are masked and come after every real token."""
    tokens, positions, mask = micro["input_ids"], micro["position_ids"], micro["attention_mask"]
    extra = -tokens.shape[1] % multiple
    if extra:
        tokens = torch.nn.functional.pad(tokens, (0, extra))
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)], 1)
        mask = torch.nn.functional.pad(mask, (0, extra))
    return tokens, positions, mask


def input_shape(micro: MicroBatch, multiple: int) -> tuple[int, int]:
    """(rows, width) of this micro-batch's model inputs: one row for a pack (this context-parallel
    rank's share of it), else the width :func:`pad_width` gives."""
    if micro.pack is not None:
        return 1, micro.pack.width if micro.pack.share is None else len(micro.pack.share.index)
    return micro["input_ids"].shape[0], -(-micro["input_ids"].shape[1] // multiple) * multiple


def model_inputs(micro: MicroBatch, multiple: int, transformer_engine: bool) -> dict:
    """GPTModel's inputs: padded rows with the mask this layer spec takes, or one pack in THD
    form, whose row boundaries keep each row's attention (and RoPE positions) to itself."""
    pack = micro.pack
    if pack is None:
        tokens, positions, mask = pad_width(micro, multiple)
        attention = padding_mask(mask) if transformer_engine else attention_mask_4d(mask)
        return {"input_ids": tokens, "position_ids": positions, "attention_mask": attention}
    from megatron.core.packed_seq_params import PackedSeqParams

    # read once per micro-batch on the host: the local spec's attention and Megatron's unfused
    # RoPE split by these boundaries in every layer (a device copy would sync there each time);
    # TransformerEngine's kernels take them on the device
    bounds = pack.cu_seqlens.cpu()
    longest = int((bounds[1:] - bounds[:-1]).max())
    cu_seqlens = pack.cu_seqlens if transformer_engine else bounds
    tokens, positions = pack.ids, pack.positions
    if pack.share is not None:  # this rank's share of the pack; the boundaries stay those of the whole pack
        tokens, positions = tokens[:, pack.share.index], positions[:, pack.share.index]
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    return {"input_ids": tokens, "position_ids": positions, "attention_mask": None, "packed_seq_params": packed}


def response_stats(micro: MicroBatch, hidden: torch.Tensor, stats: StatsFn) -> tuple[torch.Tensor, ...]:
    """Log-probs and entropy of the response tokens (``hidden``: the model's output, [b, s, h])."""
    if micro.pack is not None:
        return packed_response_stats(micro, hidden, stats)
    width, length = micro.prompt_width, micro["responses"].shape[1]
    return stats(hidden[:, width - 1 : width - 1 + length], micro["responses"])


def packed_response_stats(micro: MicroBatch, hidden: torch.Tensor, stats: StatsFn) -> tuple[torch.Tensor, ...]:
    """The same from a pack, put back in [rows, response] form. With context parallelism each
    rank scores the response tokens it holds and the rows are summed over the CP group
    (backward: each rank's share of the gradient reaches its own tokens only)."""
    positions, labels, real = response_positions(micro)
    share = micro.pack.share if micro.pack is not None else None
    if share is None:
        return tuple(scatter_rows(values, real) for values in stats(hidden[0, positions], labels))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    local = share.local[positions]
    held = local >= 0
    group = parallel_state.get_context_parallel_group()
    return tuple(
        reduce_from_tensor_model_parallel_region(
            scatter_rows(values.new_zeros(held.shape).masked_scatter(held, values), real), group
        )
        for values in stats(hidden[0, local[held]], labels[held])
    )
