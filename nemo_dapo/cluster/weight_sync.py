"""The driver's side of a weight sync: which path, and what a failure costs (docs/architecture.md, Weight sync).

``gloo``: the exporting training ranks broadcast their buckets straight to each engine's first worker
(:mod:`~nemo_dapo.transfer.gloo`, vLLM's weight-transfer API); the driver only makes the calls
and moves no tensor. The groups are built at the first sync and again whenever the engines
change (one was replaced). An engine that fails during a sync, or whose transfer broke because
another did, has half its layers reloaded: all of them are replaced, for one restart of
``rollout.max_restarts`` (one failure took them down), and warm up through the object store, as
any replaced engine does.

``object_store``: buckets through Ray's object store and a bounded queue per engine
(:meth:`RolloutGroup.update_weights`).
"""

from __future__ import annotations

import logging

from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
from nemo_dapo.errors import RemoteCallError
from nemo_dapo.policy.base import PolicyWorker
from nemo_dapo.rollout.base import RolloutWorker

log = logging.getLogger(__name__)
GLOO_DEFAULT_TIMEOUT_S = 1800.0  # gloo's own default, where the engines' calls have no deadline


class ObjectStoreSync:
    def __init__(self, policy: PolicyGroup, rollout: RolloutGroup, bucket_bytes: int) -> None:
        self.policy, self.rollout, self.bucket_bytes = policy, rollout, bucket_bytes
        self.sent_bytes: int | None = None  # by the last sync, over all senders (not counted on this path)

    def __call__(self, version: int) -> None:
        self.rollout.update_weights(self.policy.export_weights(self.bucket_bytes), version)


class CollectiveSync(ObjectStoreSync):
    def __init__(self, policy: PolicyGroup, rollout: RolloutGroup, bucket_bytes: int) -> None:
        super().__init__(policy, rollout, bucket_bytes)
        self._members: tuple | None = None  # the engines the groups were built with

    def __call__(self, version: int) -> None:
        if self._members != self._engines() and not self._connect():
            super().__call__(version)  # engines failed to join and were replaced: this round by the store
            return
        engines = self.rollout.workers
        ranks = list(range(engines.world_size))
        receiving = [worker.receive_collective.remote(version) for worker in engines.workers]
        reports = self.policy.workers.call_all(PolicyWorker.send_weights, self.bucket_bytes)
        self.sent_bytes = sum(report["sent_bytes"] for report in reports)
        errors = [report["error"] for report in reports if report["error"]]
        if errors:  # the senders left their groups: every engine still receiving fails now
            log.warning("weight sync to version %d broke: %s", version, "; ".join(errors))
        outcomes = engines.settle(receiving, "receive_collective", ranks)
        self.rollout.settle_sync(ranks, outcomes, version, one_failure=True)
        if errors or any(isinstance(outcome, RemoteCallError) for outcome in outcomes):
            self._disconnect()

    def _engines(self) -> tuple:
        """Which engines there are: a replaced one counts one more restart on its slot."""
        return tuple(self.rollout.workers.restarts)

    def _connect(self) -> bool:
        """Build the groups: each exporting rank serves a rendezvous, each engine's first worker
        joins every one (engine e at rank e + 1). False if an engine failed to join: it was
        replaced (one restart for all that failed), the senders left."""
        self._disconnect()
        engines = self.rollout.workers
        built = engines.call_all(RolloutWorker.weight_transfer_backend)
        if any(backend != "gloo" for backend in built):  # they would never join: the senders would wait
            raise RuntimeError(f"rollout.weight_transfer=gloo, but the engines were built for {built}")
        rendezvous = [url for url in self.policy.workers.call_all(PolicyWorker.open_weight_transfer) if url]
        world_size = 1 + engines.world_size
        timeout_s = engines.call_deadline.seconds or GLOO_DEFAULT_TIMEOUT_S
        joining = [
            worker.init_weight_transfer.remote(
                {
                    "rendezvous": rendezvous,
                    "rank_offset": 1 + rank,
                    "world_size": world_size,
                    "timeout_s": timeout_s,
                }
            )
            for rank, worker in enumerate(engines.workers)
        ]
        errors = [
            e for e in self.policy.workers.call_all(PolicyWorker.join_weight_transfer, world_size, timeout_s) if e
        ]
        ranks = list(range(engines.world_size))
        failed = [
            (rank, outcome)
            for rank, outcome in zip(ranks, engines.settle(joining, "init_weight_transfer", ranks))
            if isinstance(outcome, RemoteCallError)
        ]
        self.rollout.replace_failed(failed, "joining the weight transfer", one_failure=True)
        if errors or failed:
            self.policy.workers.call_all(PolicyWorker.close_weight_transfer)
            return False
        self._members = self._engines()
        return True

    def _disconnect(self) -> None:
        if self._members is not None:
            self.policy.workers.call_all(PolicyWorker.close_weight_transfer)
            self._members = None


def weight_sync(path: str, policy: PolicyGroup, rollout: RolloutGroup, bucket_bytes: int) -> ObjectStoreSync:
    """The sync ``rollout.weight_transfer`` names."""
    return (CollectiveSync if path == "gloo" else ObjectStoreSync)(policy, rollout, bucket_bytes)
