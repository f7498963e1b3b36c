"""The trainer side of vLLM's own ``nccl`` weight-transfer backend (``rollout.weight_transfer=nccl``:
GPU to GPU, for engines on GPUs of their own). NOT YET RUN: it needs CUDA and NCCL, which the
machines this was written on do not have; only what runs on a CPU is tested (the endpoint, the
engines' init info, the declaration).

The engines build vLLM's ``NCCLWeightTransferEngine`` in every worker (``weight_transfer_config=
{"backend": "nccl"}``); the exporting training rank runs vLLM's ``NCCLTrainerWeightTransferEngine``
as rank 0 of one NCCL group holding every worker of every engine, each at its own rank
(:mod:`~nemo_dapo.transfer.members`). vLLM's nccl engines keep one group per worker, so there is
one sender: validation refuses the path where several ranks export (pipeline stages).

vLLM's trainer engine takes a ``WeightSource`` that declares every tensor before sending (the
workers size their receive buffers from the declaration) and replays it each round. Our exports
stream buckets as they gather them, so the sender learns the declaration once, when it opens,
from one export run by every rank (a collective: a full gather, no transfer), and each round
iterates that round's export, which vLLM checks tensor by tensor against the declaration. The
engine-side calls of a round are the driver's (``cluster/weight_sync.py``, which replaces an
engine that fails): the client handed to vLLM's trainer engine makes none.

Unlike gloo, NCCL has no timeout here: an engine worker that dies mid-broadcast leaves the sender
blocked until the driver's call deadline (``trainer.remote_timeout_s``) fails the run, which then
resumes from its last checkpoint.

Outside contract (vLLM's ``NCCLWeightTransferEngine``): see docs/architecture.md, "Outside contracts".
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from nemo_dapo.network import own_address
from nemo_dapo.transfer.wire import Bucket

PACKED_NUM_BUFFERS = 2  # vLLM's default: one buffer broadcasts while the next is packed


def declare(export: Iterable[Bucket]) -> list[ParamMeta]:
    """Run ``export`` to its end (every rank: it is collective) and note each tensor it yields."""
    return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for bucket in export for name, tensor in bucket]


class ExportSource(WeightSource):
    """One exporting rank's tensors for vLLM's trainer engine: ``declared`` once, then each
    round's export (:meth:`take`), iterated once."""

    def __init__(self, declared: list[ParamMeta]) -> None:
        self.declared = declared
        self._round: Iterator[Bucket] | None = None

    def metadata(self) -> list[ParamMeta]:
        return self.declared

    def take(self, buckets: Iterable[Bucket]) -> None:
        self._round = iter(buckets)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._round is None:
            raise RuntimeError("nccl weight transfer: no export this round")
        buckets, self._round = self._round, None
        for bucket in buckets:
            yield from bucket


class DriverMakesTheCalls:
    """vLLM's trainer engine drives the engines through a client (init, start, update, finish);
    here the driver makes those calls on every engine itself, with each engine's rank offset, and
    replaces the engines that fail, so the trainer engine's own calls do nothing."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: Any) -> None:
        pass

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


def free_port(address: str) -> int:
    """A port free on ``address`` now (vLLM's trainer engine binds its rendezvous itself)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


class NCCLSender:
    """An exporting training rank's side of the ``nccl`` path (see the module doc)."""

    def __init__(self, declared: list[ParamMeta], bucket_bytes: int) -> None:
        self.source = ExportSource(declared)
        self.address = own_address()
        self.port = free_port(self.address)
        self.buffer_bytes = bucket_bytes
        self._transfer: Any = None

    def endpoint(self) -> dict:
        """What every engine worker needs: the rendezvous, the wire parameters both sides must
        agree on, and the declaration (vLLM's ``update_weights`` argument of every round)."""
        return {
            "master_address": self.address,
            "master_port": self.port,
            "packed": True,
            "packed_buffer_size_bytes": self.buffer_bytes,
            "packed_num_buffers": PACKED_NUM_BUFFERS,
            "update_info": {
                "names": [meta.name for meta in self.source.declared],
                "dtype_names": [str(meta.dtype).removeprefix("torch.") for meta in self.source.declared],
                "shapes": [list(meta.shape) for meta in self.source.declared],
            },
        }

    def join(self, world_size: int, timeout_s: float) -> None:
        """Open the group as its rank 0 while the engine workers join it (vLLM's rendezvous waits
        up to its own 300 s; NCCL takes no ``timeout_s``)."""
        info = NCCLTrainerInitInfo(
            self.address,
            self.port,
            world_size,
            packed=True,
            packed_buffer_size_bytes=self.buffer_bytes,
            packed_num_buffers=PACKED_NUM_BUFFERS,
            rank=0,
        )
        self._transfer = WeightTransferTrainerFactory.trainer_init(
            info, client=DriverMakesTheCalls(), source=self.source
        )

    def send(self, buckets: Iterable[Bucket]) -> int:
        """Broadcast one round's buckets; returns the bytes the declaration holds."""
        if self._transfer is None:
            raise RuntimeError("nccl weight transfer: not joined")
        self.source.take(buckets)
        self._transfer.send_weights()
        return sum(meta.dtype.itemsize * int(torch.Size(meta.shape).numel()) for meta in self.source.declared)

    def close(self) -> None:
        if self._transfer is not None:
            self._transfer.shutdown()
            self._transfer = None
