"""Sequence packing: a micro-batch's rows laid end to end in one row, with no padding between them.

Padded micro-batches compute every row at the width of the longest; packed ones compute only real
tokens (plus at most ``multiple - 1`` at the end). Rows are put into packs by first-fit decreasing
on their real lengths under the token budget. A packed micro-batch keeps the trimmed tensors of
its rows (``loss_mask``, ``advantages``, ... as :func:`microbatch.trim_padding` gives them), so
the loss sees the same [rows, response] tensors as without packing, and carries a
:class:`~nemo_dapo.policy.microbatch.Pack`: the tokens end to end, positions restarting at 0 per
row, the row boundaries (THD format, the tail padding one more segment), where each response
token is predicted, and where each packed position comes from (which puts per-token data such as
MoE routing, :mod:`routing`, in pack order). A row attends only within its own segment.
"""

from __future__ import annotations

import dataclasses

import torch

from nemo_dapo.policy.microbatch import ContextShare, MicroBatch, Pack, trim_padding


def first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices grouped so each group's total length fits ``max_tokens``: rows longest first,
    each into the first group with room (a row longer than the budget gets a group of its own)."""
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    groups: list[list[int]] = []
    room: list[int] = []
    for row in order:
        fit = next((i for i, free in enumerate(room) if lengths[row] <= free), None)
        if fit is None:
            groups.append([row])
            room.append(max_tokens - lengths[row])
        else:
            groups[fit].append(row)
            room[fit] -= lengths[row]
    return groups


def rounded_lengths(lengths: torch.Tensor, segment_multiple: int) -> torch.Tensor:
    """Each row's segment: its real length rounded up to ``segment_multiple`` (2 x CP with context
    parallelism, which splits every segment into 2 x CP chunks)."""
    return -(-lengths // segment_multiple) * segment_multiple


def pack_rows(
    batch: dict[str, torch.Tensor], rows: list[int], multiple: int = 1, width: int = 0, segment_multiple: int = 1
) -> MicroBatch:
    """One pack of ``rows``: their real tokens end to end (each row's segment padded at its end to
    ``segment_multiple``), the pack right-padded to a multiple of ``multiple`` and at least ``width``."""
    micro = trim_padding(batch, rows)
    real = micro["attention_mask"].bool()
    lengths = real.sum(dim=1)
    segments = rounded_lengths(lengths, segment_multiple)
    total = int(segments.sum())
    packed_width = max(width, -(-total // multiple) * multiple)
    segment_lengths = torch.cat([segments, torch.tensor([packed_width - total])]) if packed_width > total else segments
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(segment_lengths, 0), (1, 0)).to(torch.int32)
    starts = cu_seqlens[:-1].long()
    targets = starts[: len(rows), None] + real.long().cumsum(dim=1) - 1  # each real token's place in the pack
    packed_ids = torch.zeros(packed_width, dtype=micro["input_ids"].dtype)
    packed_ids[targets[real]] = micro["input_ids"][real]
    source = torch.full((packed_width,), -1, dtype=torch.long)
    source[targets[real]] = torch.arange(real.numel()).view(real.shape)[real]
    segment_of = torch.repeat_interleave(torch.arange(len(segment_lengths)), segment_lengths)
    response_width = micro["responses"].shape[1]
    prompt_lengths = real[:, : micro.prompt_width].sum(dim=1)
    response_index = starts[: len(rows), None] + prompt_lengths[:, None] - 1 + torch.arange(response_width)
    micro.pack = Pack(
        ids=packed_ids[None],
        positions=(torch.arange(packed_width) - starts[segment_of])[None],
        cu_seqlens=cu_seqlens,
        response_index=response_index.clamp(max=packed_width - 1),
        source=source,
    )
    return micro


def packed_micro_batches(
    batch: dict[str, torch.Tensor], max_tokens: int, multiple: int = 1, segment_multiple: int = 1
) -> list[MicroBatch]:
    """The batch's rows in packs of at most ``max_tokens`` real tokens (see the module docstring)."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return [
        pack_rows(batch, group, multiple, segment_multiple=segment_multiple)
        for group in first_fit_decreasing(lengths, max_tokens)
    ]


def uniform_packs(
    batch: dict[str, torch.Tensor], max_tokens: int, multiple: int, count_multiple: int, segment_multiple: int = 1
) -> list[MicroBatch]:
    """Packs of one width, a multiple of ``count_multiple`` of them (Megatron's interleaved pipeline
    schedule sends fixed shapes in groups of PP); filler packs repeat the first with an empty loss
    mask and no rows, so they add nothing to the loss, the gradients or the token counts."""
    lengths = batch["attention_mask"].sum(dim=1)
    groups = first_fit_decreasing(lengths.tolist(), max_tokens)
    segments = rounded_lengths(lengths, segment_multiple)
    width = max(-(-int(segments[group].sum()) // multiple) * multiple for group in groups)
    packs = [pack_rows(batch, group, multiple, width, segment_multiple) for group in groups]
    while len(packs) % count_multiple:
        packs.append(packs[0].with_loss_mask_cleared())
    return packs


def context_parallel_share(micro: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """The packed micro-batch with this context-parallel rank's share of its tokens: of every
    segment (a multiple of 2 x CP long) the chunks ``cp_rank`` and ``2 x CP - 1 - cp_rank``, in
    that order (Megatron's load-balanced split, which evens out causal attention work, and what
    its RoPE expects)."""
    pack = micro.pack
    assert pack is not None, "context parallelism shares packs"
    cu_seqlens = pack.cu_seqlens.tolist()
    pieces = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        chunk = (end - start) // (2 * cp_size)
        pieces += [
            torch.arange(start + j * chunk, start + (j + 1) * chunk) for j in (cp_rank, 2 * cp_size - 1 - cp_rank)
        ]
    index = torch.cat(pieces)
    local = torch.full((pack.width,), -1, dtype=torch.long)
    local[index] = torch.arange(len(index))
    return dataclasses.replace(micro, pack=dataclasses.replace(pack, share=ContextShare(index, local)))


def response_positions(micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pack positions [N] whose logits score its N real response tokens, those tokens [N], and the
    [rows, R] mask saying where they go (response columns after a row's end are not computed)."""
    assert micro.pack is not None
    real = micro["attention_mask"][:, micro.prompt_width :].bool()
    return micro.pack.response_index[real], micro["responses"][real], real


def scatter_rows(values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per-token ``values`` [N] back to [rows, R] (zeros where ``real`` is False); keeps gradients."""
    return values.new_zeros(real.shape).masked_scatter(real, values)
