"""The ``gloo`` backend of vLLM's weight-transfer API (``vllm.distributed.weight_transfer``),
registered with both of its factories: an engine-side engine inside every vLLM worker (each
tensor-parallel rank of each engine) and a trainer-side engine in each training rank that
exports weights (one per pipeline stage). It runs the protocol vLLM's ``nccl`` backend runs
(init, start, update, finish on the workers; ``trainer_init`` and ``send_weights`` on the
trainer) over gloo, so it works on CPUs and moves no tensor through a driver or an object store.

Each sending rank meets the engines in a group of its own (its rank 0), served by a TCPStore the
sender binds to its own address (the fabric's where ``FABRIC_IFNAME`` names one); what the group
keeps there is sealed with a secret of the sender's, which the engines get inside the endpoint
(:mod:`nemo_dapo.sealed_store`). Every engine worker joins each group at its own rank, as in
vLLM's ``nccl`` backend: the engine's ``rank_offset`` plus the worker's rank in the engine. The
workers exchange nothing among
themselves, so no CPU tensor ever meets an engine's own device group (NCCL on GPUs, which refuses
them). A worker receives stage after stage: everything the first stage's sender has, then the next.

A process whose transfer fails drops its groups at once, which closes their connections: every
peer blocked on one fails within moments instead of waiting out gloo's timeout, so one broken
receiver or sender ends the whole round quickly (the driver then replaces the engines).

Outside contract (vLLM's ``WeightTransferEngine``): see docs/architecture.md, "Outside contracts".
"""

from __future__ import annotations

import datetime
import gc
import traceback
from collections.abc import Iterable
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

from nemo_dapo.network import Rendezvous, join_store, own_address
from nemo_dapo.sealed_store import held_while
from nemo_dapo.transfer.reload import finish_reload, start_reload
from nemo_dapo.transfer.wire import Bucket, receive_buckets, send_bucket, send_end

BACKEND = "gloo"


def gloo_group(rendezvous: str, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group outside torch's default one (a vLLM worker and a training rank each already
    belong to their own), its sockets on this process's own address."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=own_address())]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    store = join_store(rendezvous, world_size)
    return held_while(dist.ProcessGroupGloo(dist.PrefixStore("weights", store), rank, world_size, options), store)


def release_groups(error: BaseException) -> None:
    """Let the gloo groups a failed transfer went through close now. A group closes its
    connections only when its last reference goes (torch 2.13's ``abort`` and ``shutdown`` leave
    gloo's sockets open: a peer blocked on them waits out the timeout), and a traceback keeps the
    frames of the failed calls, with their locals, alive as long as the error lives. The caller
    has dropped its own references; this clears the finished frames of ``error`` and of its
    causes, then collects the cycles (a suspended generator's frame)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)  # skips the frames still running (the caller's)
        current = current.__cause__ or current.__context__
    gc.collect()


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What an engine's workers need to join: one rendezvous per sending rank, in stage order;
    ``rank_offset``: the rank of the engine's first worker in every group (the others follow)."""

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
        self.groups: list[dist.ProcessGroupGloo] = []  # one per sender, in stage order

    def group_rank(self, rank_offset: int) -> int:
        """This worker's rank in each group, numbered as vLLM's nccl engine numbers its workers:
        the engine's offset, then the worker's rank over the engine's data-parallel replicas."""
        parallel = self.parallel_config
        return rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = self.group_rank(init_info.rank_offset)
        self.groups = [gloo_group(url, rank, init_info.world_size, init_info.timeout_s) for url in init_info.rendezvous]

    def start_weight_update(self) -> None:
        start_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Every sender's buckets, loaded as they come. A failure here (a broken broadcast, a
        load that raises) drops the groups before it is raised: the sender and, through it, every
        other worker fail within moments instead of waiting out the groups' timeout."""
        if not self.groups:
            raise RuntimeError("gloo weight transfer: no groups (not joined, or left after a failed round)")
        try:
            self._receive_stages()
        except BaseException as error:
            self.groups = []
            release_groups(error)
            raise

    def _receive_stages(self) -> None:
        for group in self.groups:
            for bucket in receive_buckets(group):
                self.model.load_weights(bucket)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU tensors: nothing to synchronize

    def finish_weight_update(self) -> None:
        finish_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.groups = []  # dropping a group closes its connections: a peer blocked on it fails


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
        end mark; returns the bytes sent. The workers must be in ``update_weights`` meanwhile. A
        failure (a receiver gone, the export raising) leaves the group before it is raised."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer: the group was shut down")
        try:
            sent = sum(send_bucket(self.group, bucket) for bucket in buckets)
            send_end(self.group)
        except BaseException as error:
            self.group = None
            release_groups(error)
            raise
        return sent

    def shutdown(self) -> None:
        self.group = None


class GlooSender:
    """An exporting training rank's side of the ``gloo`` path, from the rendezvous it serves to
    each round's broadcast (:class:`~nemo_dapo.policy.weight_sender.WeightSender` holds one)."""

    def __init__(self) -> None:
        self._rendezvous: Rendezvous | None = Rendezvous()
        self._transfer: GlooTrainerWeightTransferEngine | None = None

    def endpoint(self) -> dict:
        """What the engines need to join this sender's group."""
        assert self._rendezvous is not None
        return {"rendezvous": self._rendezvous.url}

    def join(self, world_size: int, timeout_s: float) -> None:
        """Meet the engine workers (they join at the same time); raises if one never comes."""
        assert self._rendezvous is not None
        info = GlooTrainerInitInfo(self._rendezvous.url, world_size, timeout_s, rank=0)
        self._transfer = WeightTransferTrainerFactory.trainer_init(info, client=None)  # type: ignore[assignment]

    def send(self, buckets: Iterable[Bucket]) -> int:
        """Broadcast one round's buckets; returns the bytes sent."""
        if self._transfer is None:
            raise RuntimeError("gloo weight transfer: not joined")
        return self._transfer.send_weights(buckets)

    def close(self) -> None:
        """Leave the group (an engine worker blocked on it fails at once) and stop the rendezvous."""
        if self._transfer is not None:
            self._transfer.shutdown()
            self._transfer = None
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None


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
