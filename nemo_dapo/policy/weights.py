"""Weight export shared by every policy backend."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]


def bucketize(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group HF-named tensors into buckets of at most ``bucket_bytes`` (a larger tensor gets its own).

    Lazy: a bucket is handed on as soon as it is full, so a streaming source never has more than
    one bucket gathered at a time.
    """
    bucket: Bucket = []
    used = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, tensor))
        used += size
    if bucket:
        yield bucket
