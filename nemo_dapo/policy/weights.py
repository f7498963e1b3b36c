"""Weight export shared by every policy backend."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]
WEIGHT_BUCKET_BYTES = 512 << 20  # a weight sync's bucket: large enough to keep the wire busy, small beside a GPU


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy when it is a view of a larger storage: pickling a view (as Ray does
    on the way to another process) writes its whole storage, so the gate and up halves of a
    fused fc1 would each carry all of it, and the q, k and v of a fused QKV all three."""
    own = tensor.untyped_storage().nbytes() == tensor.nbytes and tensor.is_contiguous()
    return tensor if own else tensor.clone(memory_format=torch.contiguous_format)


def bucketize(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group HF-named tensors into buckets of at most ``bucket_bytes`` (a larger tensor gets its own).

    Lazy: a bucket is handed on as soon as it is full, so a streaming source never has more than
    one bucket gathered at a time. Each tensor holds its own bytes only (:func:`own_storage`).
    """
    bucket: Bucket = []
    used = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, own_storage(tensor)))
        used += size
    if bucket:
        yield bucket
