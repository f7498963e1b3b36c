"""Split a rank's mini-batch into micro-batches by token budget, trimming padding.

Compute is proportional to padded width, so rows of similar length go together (sorted by
length) and each micro-batch is cut to the longest real prompt and response it contains; each
micro-batch records its rows (``ROWS``) so per-row results go back in place. Batches follow the
layout of :mod:`nemo_dapo.policy.base`: ``input_ids`` / ``attention_mask`` / ``position_ids`` are
[B, P + R] (prompt left-padded, response right-padded), as is MoE routing when it travels
(``routed_experts``, :mod:`routing`), and every other 2-D tensor is a [B, R] response-aligned field.
"""

from __future__ import annotations

import math

import torch

FULL_WIDTH_KEYS = ("input_ids", "attention_mask", "position_ids", "routed_experts")  # routing: [B, P + R, L, K]
ROWS = "rows"  # in a micro-batch: the batch rows of its real (non-filler) rows, in order


def token_budget_split(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy, order-preserving groups of row indices whose padded size fits ``max_tokens``.

    A single row longer than the budget still forms its own micro-batch.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row, length in enumerate(lengths):
        if current and max(longest, length) * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(row)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


def prompt_width(batch: dict[str, torch.Tensor]) -> int:
    return batch["input_ids"].shape[1] - batch["responses"].shape[1]


def trim_padding(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    """Select ``rows`` and drop the columns that are padding for all of them."""
    index = torch.tensor(rows, dtype=torch.long)
    width = prompt_width(batch)
    attention = batch["attention_mask"][index]
    prompt_keep = int(attention[:, :width].sum(dim=1).max().item())
    response_keep = max(int(attention[:, width:].sum(dim=1).max().item()), 1)
    out = {}
    for name, tensor in batch.items():
        part = tensor[index]
        if name in FULL_WIDTH_KEYS:
            part = part[:, width - prompt_keep : width + response_keep]
        elif part.dim() >= 2:
            part = part[:, :response_keep]
        out[name] = part
    out[ROWS] = index
    return out


def micro_batches(batch: dict[str, torch.Tensor], max_tokens: int) -> list[dict[str, torch.Tensor]]:
    """Rows longest first, cut greedily by token budget: similar lengths share a micro-batch."""
    lengths = batch["attention_mask"].sum(dim=1)
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    groups = token_budget_split([int(lengths[row]) for row in order], max_tokens)
    return [trim_padding(batch, [order[i] for i in group]) for group in groups]


def place_rows(shape: torch.Size, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A ``shape`` tensor (zeros elsewhere) with each micro-batch's ``(rows, values)`` put back in
    place; a micro-batch's values may be narrower than ``shape`` (trimmed response padding)."""
    out = torch.zeros(shape)
    for rows, values in parts:
        out[rows, : values.shape[1]] = values.float()
    return out


def uniform_micro_batches(
    batch: dict[str, torch.Tensor], max_tokens: int, multiple: int
) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of one shape, a multiple of ``multiple`` of them, for schedules that send fixed
    shapes between pipeline stages (Megatron's interleaved one).

    The batch is trimmed once and cut into equal row groups; the last groups are filled with
    copies of the first row whose ``response_mask`` is 0 (they add nothing to loss, gradients or
    token counts); ``ROWS`` names the real ones, which come first.
    """
    rows = batch["input_ids"].shape[0]
    trimmed = trim_padding(batch, list(range(rows)))
    del trimmed[ROWS]  # set per micro-batch below
    per_micro = max(1, min(rows, max_tokens // trimmed["input_ids"].shape[1]))
    count = math.ceil(math.ceil(rows / per_micro) / multiple) * multiple
    per_micro = math.ceil(rows / count)
    filler = {k: v[:1].clone() for k, v in trimmed.items()}
    filler["response_mask"] = torch.zeros_like(filler["response_mask"])
    micros = []
    for start in range(0, count * per_micro, per_micro):
        real = max(0, min(per_micro, rows - start))
        part = {k: torch.cat([v[start : start + real]] + [filler[k]] * (per_micro - real)) for k, v in trimmed.items()}
        part[ROWS] = torch.arange(start, start + real)
        micros.append(part)
    return micros
