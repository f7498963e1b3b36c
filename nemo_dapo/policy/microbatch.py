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


def token_budget_split(
    widths: list[tuple[int, int]], max_tokens: int, prompt_keys: list[int] | None = None
) -> list[list[int]]:
    """Consecutive groups of rows (given longest first as ``(prompt, response)`` lengths) whose
    padded size, rows x (longest prompt + longest response), fits ``max_tokens``: the fewest
    groups, and among those the fewest padded tokens. A single row longer than the budget still
    forms its own group. With ``prompt_keys`` (each row's distinct prompt) a prompt shared by
    rows of a group counts once, as the shared prompt forward computes it
    (:mod:`~nemo_dapo.policy.shared_prompt`).

    Why not greedy: filling each group in turn makes as few groups, but puts a long row (a
    response that ran to the length limit) with as many short rows as fit and pads them all to
    its length: with 63 answers of 7 tokens and one of 128 (39-token prompts), the first
    micro-batch computes 1002 tokens for 397 real ones, +20% on the whole step. Dynamic
    programming over the cut points finds the split that leaves the long row alone.
    """
    rows = len(widths)
    best: list[tuple[int, int]] = [(0, 0)] * (rows + 1)  # (groups, padded tokens) of rows i..end
    cut = [rows] * (rows + 1)  # where the first group of rows i..end ends
    for start in range(rows - 1, -1, -1):
        prompt = response = 0
        distinct: set[int] = set()
        for end in range(start + 1, rows + 1):
            prompt, response = max(prompt, widths[end - 1][0]), max(response, widths[end - 1][1])
            distinct.add(end - 1 if prompt_keys is None else prompt_keys[end - 1])
            size = len(distinct) * prompt + (end - start) * response
            if size > max_tokens and end > start + 1:
                break  # a longer group only grows
            count, padded = best[end]
            candidate = (count + 1, padded + size)
            if end == start + 1 or candidate < best[start]:
                best[start], cut[start] = candidate, end
    groups, start = [], 0
    while start < rows:
        groups.append(list(range(start, cut[start])))
        start = cut[start]
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


def prompt_groups(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's index among the batch's distinct prompts (the same tokens and the same padding)."""
    width = prompt_width(batch)
    prompts = torch.cat([batch["input_ids"][:, :width], batch["attention_mask"][:, :width]], dim=1)
    return torch.unique(prompts, dim=0, return_inverse=True)[1]


def shares_prompts(batch: dict[str, torch.Tensor], share: bool) -> bool:
    """Whether ``batch``'s rows go through the decoder with each distinct prompt once, asked by
    ``share``: not with MoE routing to replay, where each row follows its own recorded routes,
    prompt included."""
    return share and "routed_experts" not in batch


def micro_batches(
    batch: dict[str, torch.Tensor], max_tokens: int, share_prompts: bool = False
) -> list[dict[str, torch.Tensor]]:
    """Rows longest first, cut by token budget (:func:`token_budget_split`): similar lengths share a
    micro-batch. ``share_prompts``: the budget counts each distinct prompt of a micro-batch once."""
    attention = batch["attention_mask"]
    width = prompt_width(batch)
    prompts = attention[:, :width].sum(dim=1).tolist()
    responses = attention[:, width:].sum(dim=1).clamp(min=1).tolist()  # trim_padding keeps one column at least
    order = torch.argsort(attention.sum(dim=1), descending=True, stable=True).tolist()
    keys = prompt_groups(batch).tolist() if shares_prompts(batch, share_prompts) else None
    widths = [(prompts[row], responses[row]) for row in order]
    groups = token_budget_split(widths, max_tokens, None if keys is None else [keys[row] for row in order])
    return [trim_padding(batch, [order[i] for i in group]) for group in groups]


def place_rows(shape: torch.Size, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A ``shape`` tensor (zeros elsewhere) with each micro-batch's ``(rows, values)`` put back in
    place; a micro-batch's values may be narrower than ``shape`` (trimmed response padding)."""
    out = torch.zeros(shape)
    for rows, values in parts:
        out[rows, : values.shape[1]] = values.float()
    return out


class RowStats:
    """Per-token log-probs and entropy of a pass over micro-batches, put back in batch row order."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, rows: torch.Tensor, log_probs: torch.Tensor, entropy: torch.Tensor) -> None:
        """One micro-batch's values; its first ``len(rows)`` rows are the batch's ``rows`` (the
        rest, if any, are filler rows)."""
        count = len(rows)
        self.parts.append((rows.cpu(), log_probs[:count].detach().cpu(), entropy[:count].detach().cpu()))

    def placed(self, shape: torch.Size) -> dict[str, torch.Tensor]:
        """``log_probs`` and ``entropy`` as ``shape`` tensors, zero where no micro-batch put a value."""
        return {
            "log_probs": place_rows(shape, [(rows, log_probs) for rows, log_probs, _ in self.parts]),
            "entropy": place_rows(shape, [(rows, entropy) for rows, _, entropy in self.parts]),
        }


def within_responses(values: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """[B, R] ``values`` of ``batch``'s rows, zero outside each row's generated tokens (the response
    part of its attention mask: the loss mask, ``response_mask`` here, may be narrower)."""
    mask = batch["attention_mask"][:, -batch["responses"].shape[1] :].float()
    return {key: value * mask for key, value in values.items()}


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
