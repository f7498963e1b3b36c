"""A weight bucket on a broadcast: its sizes, a JSON header (name, dtype, shape of each tensor),
then every tensor's bytes in one flat buffer. The header travels in band, so the receiver needs
nothing declared in advance and the sender streams buckets as its export gathers them (a
pipeline stage's exporter does not know the whole model's names). Each tensor starts at a
multiple of ``ALIGN`` bytes, so the receiver views the buffer as the tensors without a copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import torch
import torch.distributed as dist

Bucket = list[tuple[str, torch.Tensor]]
ALIGN = 64
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
    torch.uint8, torch.bool,
)}  # fmt: skip


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def send_bucket(group: dist.ProcessGroup, bucket: Bucket) -> int:
    """Broadcast one bucket from rank 0 of ``group``; returns the payload's bytes."""
    header = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in bucket]
    encoded = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    sizes = [_aligned(t.numel() * t.element_size()) for _, t in bucket]
    payload = torch.zeros(sum(sizes), dtype=torch.uint8)
    offset = 0
    for (_, tensor), size in zip(bucket, sizes):
        raw = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
        payload[offset : offset + raw.numel()] = raw
        offset += size
    broadcast(group, torch.tensor([encoded.numel(), payload.numel()], dtype=torch.int64))
    broadcast(group, encoded)
    broadcast(group, payload)
    return payload.numel()


def send_end(group: dist.ProcessGroup) -> None:
    """Tell the receivers this sender has no more buckets this round."""
    broadcast(group, torch.zeros(2, dtype=torch.int64))


def receive_buckets(group: dist.ProcessGroup) -> Iterator[Bucket]:
    """The buckets rank 0 of ``group`` sends, until its end mark. Each bucket's tensors are views
    of one received buffer (the model's ``load_weights`` copies them into its parameters)."""

    while True:
        sizes = torch.empty(2, dtype=torch.int64)
        broadcast(group, sizes)
        header_bytes, payload_bytes = (int(s) for s in sizes)
        if header_bytes == 0:
            return
        encoded = torch.empty(header_bytes, dtype=torch.uint8)
        payload = torch.empty(payload_bytes, dtype=torch.uint8)
        broadcast(group, encoded)
        broadcast(group, payload)
        yield list(_unpack(json.loads(bytes(encoded.numpy())), payload))


def _unpack(header: list, payload: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for name, dtype_name, shape in header:
        dtype = DTYPES[dtype_name]
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        yield name, payload[offset : offset + nbytes].view(dtype).view(shape)
        offset += _aligned(nbytes)
