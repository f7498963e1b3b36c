"""The ``gloo`` backend of vLLM's weight-transfer API (``vllm.distributed.weight_transfer``),
registered with both of its factories: an engine-side engine inside every vLLM worker (each
tensor-parallel rank of each engine) and a trainer-side engine in each training rank that
exports weights (one per pipeline stage). It runs the protocol vLLM's ``nccl`` backend runs
(init, start, update, finish on the workers; ``trainer_init`` and ``send_weights`` on the
trainer) over gloo, so it works on CPUs and moves no tensor through a driver or an object store.

Each sending rank meets the engines in a group of its own (its rank 0; engine e's first worker
at ``rank_offset`` = e + 1), served by a TCPStore the sender binds to its own address (the
fabric's where ``FABRIC_IFNAME`` names one). An engine's first worker passes every broadcast on
to its other workers over the engine's own group (its TP ranks: one node, shared memory or
NVLink), so the model crosses the network once per engine, not once per worker. A worker
receives stage after stage: everything the first stage's sender has, then the next.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from nemo_dapo.network import join_store, own_address
from nemo_dapo.transfer.reload import finish_reload, start_reload
from nemo_dapo.transfer.wire import receive_buckets, send_bucket, send_end

BACKEND = "gloo"


def gloo_group(rendezvous: str, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group outside torch's default one (a vLLM worker and a training rank each already
    belong to their own), its sockets on this process's own address."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=own_address())]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore("weights", join_store(rendezvous, world_size))
    return dist.ProcessGroupGloo(store, rank, world_size, options)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What an engine's workers need to join: one rendezvous per sending rank, in stage order;
    ``rank_offset`` is the engine's rank in each group."""

    rendezvous: list[str]
    rank_offset: int
    world_size: int
    timeout_s: float


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """Buckets carry their own names and shapes (:mod:`~nemo_dapo.transfer.wire`); the round only
    names the version it brings."""

    version: int


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Engine side, in a vLLM worker: receives every sender's buckets and loads each as it comes
    within vLLM's layer-wise reload (the parameters keep their storage)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: list[dist.ProcessGroupGloo] = []  # the first worker's, one per sender
        self.senders = 0
        self.engine_group: dist.ProcessGroup | None = None  # the engine's workers, when more than one

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group

        world = get_world_group()
        self.engine_group = world.device_group if world.world_size > 1 else None
        self.senders = len(init_info.rendezvous)
        if world.rank_in_group == 0:
            self.groups = [
                gloo_group(url, init_info.rank_offset, init_info.world_size, init_info.timeout_s)
                for url in init_info.rendezvous
            ]

    def start_weight_update(self) -> None:
        start_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if not self.senders:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        for stage in range(self.senders):
            if self.groups:  # the engine's first worker: from the sender, passed on to the others
                buckets = receive_buckets(self.groups[stage], relay=self.engine_group)
            else:
                assert self.engine_group is not None
                buckets = receive_buckets(self.engine_group)
            for bucket in buckets:
                self.model.load_weights(bucket)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU tensors: nothing to synchronize

    def finish_weight_update(self) -> None:
        finish_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.groups, self.senders = [], 0  # dropping a group closes its connections: a peer blocked on it fails


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """A sending rank's side of its group (it is ``rank`` 0 there)."""

    backend: ClassVar[str] = BACKEND

    rendezvous: str
    world_size: int
    timeout_s: float


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side, in a training rank that exports weights: broadcasts each bucket of its export
    as the export gathers it. The buckets are the round's payload (``send_weights(buckets)``), not
    a ``WeightSource``: a pipeline stage's exporter knows only its own stage's names."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: Any, group: dist.ProcessGroupGloo) -> None:
        super().__init__(client=client, source=None, is_sender=True)
        self.group: dist.ProcessGroupGloo | None = group

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None
    ) -> GlooTrainerWeightTransferEngine:
        if source is not None:
            raise ValueError("the gloo trainer engine takes each round's buckets in send_weights, not a WeightSource")
        group = gloo_group(init_info.rendezvous, init_info.rank, init_info.world_size, init_info.timeout_s)
        return cls(client=client, group=group)

    def send_weights(self, buckets: Any = ()) -> int:  # type: ignore[override]
        """Broadcast ``buckets`` (an iterable of :data:`~nemo_dapo.transfer.wire.Bucket`), then the
        end mark; returns the bytes sent. The workers must be in ``update_weights`` meanwhile."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer: the group was shut down")
        sent = sum(send_bucket(self.group, bucket) for bucket in buckets)
        send_end(self.group)
        return sent

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Make ``gloo`` a backend of both factories (once per process; vLLM's workers call this on
    importing our worker extension, before their model loads)."""
    for factory, engine in (
        (WeightTransferEngineFactory, GlooWeightTransferEngine),
        (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine),
    ):
        try:
            factory.register_engine(BACKEND, engine)
        except ValueError:  # registered already in this process
            pass
