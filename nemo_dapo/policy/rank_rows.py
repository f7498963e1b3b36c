"""One training rank's rows on their way to it: own bytes only, narrow integers, no padding.

A rank's rows are a dict of tensors (:func:`~nemo_dapo.policy.inputs.shard`): full-width fields
[B, P + R] (prompt left-padded, response right-padded, as ``attention_mask`` says) and
response-aligned ones [B, R]. Pickled (by Ray, to the rank) as a :class:`RankRows`:

- each tensor is its own bytes (a row slice is a view whose storage is the whole batch, and
  pickling a view writes that whole storage);
- ``attention_mask`` of that shape travels as two lengths per row; every other field whose
  padding is all zeros travels as its real elements only (those of the attention mask, or of
  its response part), so no padding crosses the wire at all, whatever the batch's widths;
- integers travel as ``bool`` when they are all 0 or 1 and as ``int32`` when they fit.

Unpickling rebuilds every tensor as it was, shape and dtype included, so the workers read exactly
the tensors the driver cut (docs/architecture.md, "What a rank receives"); a field whose padding
is not zeros travels whole.
"""

from __future__ import annotations

import torch

from nemo_dapo.policy.weights import own_storage

INT32 = torch.iinfo(torch.int32)
WHOLE, REAL, REAL_RESPONSE, LENGTHS = "whole", "real", "real_response", "lengths"  # how a field travels


class RankRows(dict):
    """One rank's rows (field name -> tensor), which travel without padding and arrive as sent."""

    def __reduce__(self):
        return _restore, (_pack(self),)


def _pack(rows: dict[str, torch.Tensor]) -> dict[str, tuple]:
    lengths, real = _lengths(rows)
    fields = {}
    for name, tensor in rows.items():
        if name == "attention_mask" and lengths is not None:  # rebuilt from the lengths
            fields[name] = LENGTHS, _compact(lengths), tensor.shape, tensor.dtype
        else:
            fields[name] = _packed_field(tensor, real)
    return fields


def _lengths(rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Each row's (prompt, response) lengths when ``attention_mask`` is left-padded prompts then
    right-padded responses, and the masks of the real elements by field kind."""
    if "attention_mask" not in rows or "responses" not in rows:
        return None, {}
    attention, response_width = rows["attention_mask"], rows["responses"].shape[1]
    prompt_width = attention.shape[1] - response_width
    lengths = torch.stack([attention[:, :prompt_width].sum(dim=1), attention[:, prompt_width:].sum(dim=1)], dim=1)
    if not torch.equal(_mask(lengths, prompt_width, response_width).to(attention.dtype), attention):
        return None, {}
    real = attention.bool()
    return lengths, {REAL: real, REAL_RESPONSE: real[:, prompt_width:]}


def _mask(lengths: torch.Tensor, prompt_width: int, response_width: int) -> torch.Tensor:
    prompt = torch.arange(prompt_width)[None, :] >= prompt_width - lengths[:, :1]
    response = torch.arange(response_width)[None, :] < lengths[:, 1:]
    return torch.cat([prompt, response], dim=1)


def _packed_field(tensor: torch.Tensor, real: dict[str, torch.Tensor]) -> tuple:
    """(how, values, shape, dtype): the real elements when the padding is zeros, else the whole."""
    for how, mask in real.items():
        if tensor.dim() >= 2 and tensor.shape[:2] == mask.shape and not tensor[~mask].any():
            return how, _compact(tensor[mask]), tensor.shape, tensor.dtype
    return WHOLE, _compact(tensor), tensor.shape, tensor.dtype


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor with no storage beyond its own elements, in the narrowest lossless integer type."""
    if tensor.dtype in (torch.int64, torch.int32, torch.int16) and tensor.numel():
        low, high = int(tensor.min()), int(tensor.max())
        if low >= 0 and high <= 1:
            return tensor.to(torch.bool)
        if tensor.dtype == torch.int64 and INT32.min <= low and high <= INT32.max:
            return tensor.to(torch.int32)
    return own_storage(tensor)


def _restore(fields: dict[str, tuple]) -> RankRows:
    real: dict[str, torch.Tensor] = {}
    if fields.get("attention_mask", (WHOLE,))[0] == LENGTHS:
        _, lengths, shape, _ = fields["attention_mask"]
        response_width = fields["responses"][2][1]
        mask = _mask(lengths.long(), shape[1] - response_width, response_width)
        real = {REAL: mask, REAL_RESPONSE: mask[:, shape[1] - response_width :]}
    rows = RankRows()
    for name, (how, values, shape, dtype) in fields.items():
        if how == WHOLE:
            rows[name] = values.to(dtype)
        elif how == LENGTHS:
            rows[name] = real[REAL].to(dtype)
        else:
            rows[name] = torch.zeros(shape, dtype=dtype)
            rows[name][real[how]] = values.to(dtype)
    return rows
