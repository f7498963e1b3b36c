"""Sequence packing: a micro-batch's rows laid end to end in one row, with no padding between them.

Padded micro-batches compute every row at the width of the longest; packed ones compute only real
tokens (plus at most ``multiple - 1`` at the end). Rows are put into packs by first-fit decreasing
on their real lengths under the token budget. Each pack keeps the trimmed response-aligned fields
of its rows (``response_mask``, ``advantages``, ... as :func:`microbatch.trim_padding` gives them),
so the loss sees the same [rows, response] tensors as without packing, and adds:

- ``packed_ids`` / ``packed_positions`` [1, T]: the tokens, and positions restarting at 0 per row;
- ``cu_seqlens`` [segments + 1] int32: row boundaries, the tail padding one more segment (THD format);
- ``response_index`` [rows, R]: the packed position whose logits predict each response token.

A row attends only within its own segment (the THD boundaries).
"""

from __future__ import annotations

import torch

from nemo_dapo.policy.microbatch import ROWS, prompt_width, trim_padding

PACKED_IDS = "packed_ids"


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


def pack_rows(batch: dict[str, torch.Tensor], rows: list[int], multiple: int = 1, width: int = 0) -> dict[str, torch.Tensor]:
    """One pack of ``rows``: their real tokens end to end, right-padded to a multiple of ``multiple``
    (and to at least ``width``)."""
    micro = trim_padding(batch, rows)
    real = micro["attention_mask"].bool()
    lengths = real.sum(dim=1)
    total = int(lengths.sum())
    packed_width = max(width, -(-total // multiple) * multiple)
    segment_lengths = torch.cat([lengths, torch.tensor([packed_width - total])]) if packed_width > total else lengths
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(segment_lengths, 0), (1, 0)).to(torch.int32)
    segments = torch.repeat_interleave(torch.arange(len(segment_lengths)), segment_lengths)
    starts = cu_seqlens[:-1].long()
    response_width = micro["responses"].shape[1]
    prompt_lengths = real[:, : prompt_width(micro)].sum(dim=1)
    response_index = starts[: len(lengths), None] + prompt_lengths[:, None] - 1 + torch.arange(response_width)
    micro.update({
        PACKED_IDS: torch.nn.functional.pad(micro["input_ids"][real], (0, packed_width - total))[None],
        "packed_positions": (torch.arange(packed_width) - starts[segments])[None],
        "cu_seqlens": cu_seqlens,
        "response_index": response_index.clamp(max=packed_width - 1),
    })
    return micro


def packed_micro_batches(batch: dict[str, torch.Tensor], max_tokens: int, multiple: int = 1) -> list[dict[str, torch.Tensor]]:
    """The batch's rows in packs of at most ``max_tokens`` real tokens (see the module docstring)."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return [pack_rows(batch, group, multiple) for group in first_fit_decreasing(lengths, max_tokens)]


def uniform_packs(batch: dict[str, torch.Tensor], max_tokens: int, multiple: int, count_multiple: int) -> list[dict[str, torch.Tensor]]:
    """Packs of one width, a multiple of ``count_multiple`` of them (Megatron's interleaved pipeline
    schedule sends fixed shapes in groups of PP); filler packs repeat the first with ``response_mask``
    0 and no ``ROWS``, so they add nothing to the loss, the gradients or the token counts."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    groups = first_fit_decreasing(lengths, max_tokens)
    width = max(-(-sum(lengths[row] for row in group) // multiple) * multiple for group in groups)
    packs = [pack_rows(batch, group, multiple, width) for group in groups]
    while len(packs) % count_multiple:
        filler = dict(packs[0])
        filler["response_mask"] = torch.zeros_like(filler["response_mask"])
        filler[ROWS] = filler[ROWS][:0]
        packs.append(filler)
    return packs


def packed_width(pack: dict[str, torch.Tensor]) -> int:
    return pack[PACKED_IDS].shape[1]


def unpack_response_logits(logits: torch.Tensor, pack: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits [N, V] at the pack's N real response positions, their labels [N] and the [rows, R]
    mask saying where they go (response tokens after a row's end are not computed)."""
    real = pack["attention_mask"][:, prompt_width(pack):].bool()
    return logits[0, pack["response_index"][real]], pack["responses"][real], real


def scatter_rows(values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per-token ``values`` [N] back to [rows, R] (zeros where ``real`` is False); keeps gradients."""
    return values.new_zeros(real.shape).masked_scatter(real, values)
