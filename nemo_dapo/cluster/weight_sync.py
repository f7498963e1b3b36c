"""The driver's side of a weight sync: which path, and what a failure costs (docs/architecture.md, Weight sync).

The collective paths (``gloo``; ``nccl``, not yet run): the exporting training ranks send their
buckets straight to every worker of every engine through vLLM's weight-transfer API; the driver
only makes the calls and moves no tensor. The groups are built at the first sync and again
whenever the engines change (one was replaced). An engine that fails during a sync, or whose
transfer broke because another did, has half its layers reloaded: all of them are replaced, for
one restart of ``rollout.max_restarts`` (one failure took them down), and warm up through the
object store, as any replaced engine does. Over gloo a failed receiver or sender leaves its
groups at once, so the others fail within moments, not at gloo's timeout.

``object_store``: buckets through Ray's object store and a bounded queue per engine
(:mod:`~nemo_dapo.cluster.store_sync`, which every replaced engine's warm-up takes too).

Both transports are called with the new version and keep ``sent_bytes`` of their last sync.
"""

from __future__ import annotations

import logging

from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
from nemo_dapo.cluster.worker_group import rank_call
from nemo_dapo.policy.base import PolicyWorker
from nemo_dapo.rollout.base import RolloutWorker
from nemo_dapo.transfer import members

log = logging.getLogger(__name__)
GLOO_DEFAULT_TIMEOUT_S = 1800.0  # gloo's own default, where the engines' calls have no deadline


class ObjectStoreSync:
    """The policy's buckets through the rollout group's object-store path."""

    def __init__(self, policy: PolicyGroup, rollout: RolloutGroup, bucket_bytes: int) -> None:
        self.policy, self.rollout, self.bucket_bytes = policy, rollout, bucket_bytes
        self.sent_bytes: int | None = None  # by the last sync, over all senders (not counted on this path)

    def __call__(self, version: int) -> None:
        self.rollout.store.send(self.policy.export_weights(self.bucket_bytes), version)


class CollectiveSync:
    """The exporting ranks' buckets straight to every engine worker over vLLM's weight-transfer API."""

    def __init__(self, policy: PolicyGroup, rollout: RolloutGroup, bucket_bytes: int, backend: str = "gloo") -> None:
        self.policy, self.rollout, self.bucket_bytes, self.backend = policy, rollout, bucket_bytes, backend
        self.sent_bytes: int | None = None  # by the last sync, over all senders
        self._store = ObjectStoreSync(policy, rollout, bucket_bytes)  # a round whose engines could not join
        self._members: tuple | None = None  # the engines the groups were built with
        self._endpoints: list[dict] = []  # the exporting ranks', in stage order

    def __call__(self, version: int) -> None:
        if self._members != self._engines() and not self._connect():
            self._store(version)  # engines failed to join and were replaced: this round by the store
            return
        update = members.update_info(self.backend, self._endpoints, version)
        every = dict.fromkeys(self.rollout.in_service(), rank_call(RolloutWorker.receive_collective, version, update))
        receiving = self.rollout.start(every)
        reports = self.policy.workers.call_all(PolicyWorker.send_weights, self.bucket_bytes)
        self.sent_bytes = sum(report["sent_bytes"] for report in reports)
        errors = [report["error"] for report in reports if report["error"]]
        if errors:  # the senders left their groups: every engine still receiving fails now
            log.warning("weight sync to version %d broke: %s", version, "; ".join(errors))
        received = self.rollout.finish(receiving, "during a weight sync", one_failure=True)
        self.rollout.synced(received, version)
        if errors or len(received) < len(every):
            self._disconnect()

    def _engines(self) -> tuple:
        """Which engines there are: a replaced one counts one more restart on its slot, a lost one
        is out of service."""
        return tuple(self.rollout.workers.restarts), tuple(self.rollout.in_service())

    def _connect(self) -> bool:
        """Build the groups: each exporting rank opens an endpoint, every worker of every engine
        joins each one at its own rank (:mod:`~nemo_dapo.transfer.members`). False if an engine
        failed to join: it was replaced (one restart for all that failed) or lost, the senders left."""
        self._disconnect()
        ranks = self.rollout.in_service()
        answered = self.rollout.fan_out(
            dict.fromkeys(ranks, rank_call(RolloutWorker.weight_transfer_setup)), "joining the weight transfer"
        )
        if len(answered) < len(ranks):  # an engine failed (replaced) or was lost: this round by the store
            return False
        setups = [answered[rank] for rank in ranks]
        built = [backend for backend, _ in setups]
        if any(backend != self.backend for backend in built):  # they would never join: the senders would wait
            raise RuntimeError(f"rollout.weight_transfer={self.backend}, but the engines were built for {built}")
        offsets, world_size = members.rank_offsets([workers for _, workers in setups])
        opened = self.policy.workers.call_all(PolicyWorker.open_weight_transfer, self.backend, self.bucket_bytes)
        self._endpoints = [endpoint for endpoint in opened if endpoint]
        timeout_s = self.rollout.workers.call_deadline.seconds or GLOO_DEFAULT_TIMEOUT_S
        infos = {
            rank: rank_call(
                RolloutWorker.init_weight_transfer,
                members.engine_init_info(self.backend, self._endpoints, offset, world_size, timeout_s),
            )
            for rank, offset in zip(ranks, offsets)
        }
        joining = self.rollout.start(infos)
        errors = [
            e for e in self.policy.workers.call_all(PolicyWorker.join_weight_transfer, world_size, timeout_s) if e
        ]
        joined = self.rollout.finish(joining, "joining the weight transfer", one_failure=True)
        if errors or len(joined) < len(infos):
            self.policy.workers.call_all(PolicyWorker.close_weight_transfer)
            return False
        self._members = self._engines()
        return True

    def _disconnect(self) -> None:
        if self._members is not None:
            self.policy.workers.call_all(PolicyWorker.close_weight_transfer)
            self._members = None


def weight_sync(
    path: str, policy: PolicyGroup, rollout: RolloutGroup, bucket_bytes: int
) -> ObjectStoreSync | CollectiveSync:
    """The sync ``rollout.weight_transfer`` names (made concrete when the config loaded)."""
    if path == "object_store":
        return ObjectStoreSync(policy, rollout, bucket_bytes)
    return CollectiveSync(policy, rollout, bucket_bytes, backend=path)
