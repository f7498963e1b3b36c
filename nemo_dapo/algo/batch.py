"""RolloutBatch: what moves between the stages of a training step.

A dict of tensors (first dimension = sequence) plus per-sample non-tensor fields (uid,
data_source, ground truth, reward extras) and batch-level ``meta``. Stages add fields and
never rewrite those of another stage, so a step can be audited field by field.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# 2-D tensors padded on the left (prompts end where the response starts); all others on the right.
LEFT_PADDED = frozenset({"prompts", "prompt_mask", "prompt_routing"})


@dataclass
class RolloutBatch:
    """One step's samples, one row per sequence: ``tensors`` (ids, masks, log-probs, advantages,
    first dimension the rows), ``fields`` (per-row Python values: uid, data source, ground truth)
    and ``meta`` (batch-level). Indexing by name reads either; :meth:`add` puts a new field."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    fields: dict[str, list] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {name: t.shape[0] for name, t in self.tensors.items()}
        sizes.update({name: len(v) for name, v in self.fields.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"RolloutBatch fields disagree on the number of sequences: {sizes}")

    def __len__(self) -> int:
        for values in (*self.tensors.values(), *self.fields.values()):
            return len(values)
        return 0

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.fields

    def __getitem__(self, name: str):
        if name in self.tensors:
            return self.tensors[name]
        if name in self.fields:
            return self.fields[name]
        raise KeyError(f"RolloutBatch has no field {name!r}; it has {sorted(self.keys())}")

    def keys(self) -> list[str]:
        return [*self.tensors, *self.fields]

    def add(self, name: str, value, *, overwrite: bool = False) -> None:
        """Add a stage's output; refuses to silently replace another stage's field."""
        if name in self and not overwrite:
            raise KeyError(f"RolloutBatch already has {name!r}; stages add fields, they do not rewrite them")
        if len(self) and len(value) != len(self):
            raise ValueError(f"field {name!r} has {len(value)} rows, the batch has {len(self)}")
        target = self.tensors if isinstance(value, torch.Tensor) else self.fields
        target[name] = value if isinstance(value, torch.Tensor) else list(value)

    def narrow_loss_mask(self, keep: torch.Tensor) -> None:
        """Take tokens out of the loss: ``loss_mask`` (every response token when the batch is built)
        keeps only where ``keep`` ([B, R], or [B, 1] for whole rows) is true as well. The one field
        several stages change, each only ever narrowing it (overlong filtering, stale tokens,
        rejection sampling), so their order does not matter."""
        mask = self.tensors["loss_mask"]
        self.tensors["loss_mask"] = mask * keep.to(mask.dtype)

    def select(self, rows: Sequence[int] | torch.Tensor) -> RolloutBatch:
        index = torch.as_tensor(rows, dtype=torch.long)
        positions = index.tolist()
        return RolloutBatch(
            {name: t[index] for name, t in self.tensors.items()},
            {name: [values[i] for i in positions] for name, values in self.fields.items()},
            dict(self.meta),
        )

    @staticmethod
    def concat(batches: Iterable[RolloutBatch]) -> RolloutBatch:
        """Stack batches row-wise, padding 2-D tensors of different widths with zeros."""
        batches = [b for b in batches if len(b)]
        if not batches:
            return RolloutBatch()
        names = batches[0].keys()
        for b in batches[1:]:
            if sorted(b.keys()) != sorted(names):
                raise ValueError(f"cannot concat batches with different fields: {sorted(names)} vs {sorted(b.keys())}")
        tensors = {
            name: _pad_and_cat([b.tensors[name] for b in batches], left=name in LEFT_PADDED)
            for name in batches[0].tensors
        }
        fields = {name: [v for b in batches for v in b.fields[name]] for name in batches[0].fields}
        return RolloutBatch(tensors, fields, dict(batches[0].meta))


def _pad_and_cat(parts: list[torch.Tensor], left: bool) -> torch.Tensor:
    if parts[0].dim() < 2:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    padded = []
    for p in parts:
        gap = width - p.shape[1]
        pad = (gap, 0) if left else (0, gap)
        padded.append(torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + pad) if gap else p)
    return torch.cat(padded)


def group_rows(group_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Row indices of each group, groups in first-appearance order."""
    members: dict[Hashable, list[int]] = {}
    for row, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(row)
    return members
