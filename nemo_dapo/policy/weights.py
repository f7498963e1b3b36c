"""Weight export shared by every policy backend."""

from __future__ import annotations

from typing import Iterable

import torch


def bucketize(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Group HF-named tensors into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if buckets[-1] and used + size > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append((name, tensor))
        used += size
    return buckets
