"""Weights into the engines through Ray's object store (``rollout.weight_transfer=object_store``,
and every replaced engine's warm-up): bucket refs pass through a bounded queue per engine, each
engine fetches a bucket itself as it loads, so no process holds the whole model on the way.

The sync has the rollout group's call deadline: an engine that dies, or takes no bucket for that
long, is replaced as a failed generation is (it gets the weights before it next generates) while
the others sync on; past ``rollout.max_restarts`` the run stops naming the engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from nemo_dapo.cluster.worker_group import Calls, RankCall, WorkerGroup, rank_call
from nemo_dapo.errors import RemoteCallError
from nemo_dapo.rollout.base import RolloutWorker

BUCKETS_AHEAD = 2  # weight buckets a policy rank may gather ahead of the engines: each queue's depth
STAGE = "during a weight sync"


class Engines(Protocol):
    """What this transport uses of :class:`~nemo_dapo.cluster.groups.RolloutGroup`."""

    workers: WorkerGroup

    def in_service(self) -> list[int]: ...

    def start(self, calls: Mapping[int, RankCall]) -> Calls: ...

    def finish(self, calls: Calls, stage: str) -> dict[int, Any]: ...

    def replace(self, rank: int, error: RemoteCallError, stage: str) -> None: ...

    def synced(self, reported: dict[int, int], version: int) -> None: ...


class StoreSync:
    """The object-store transport of one rollout group."""

    def __init__(self, rollout: Engines) -> None:
        self.rollout = rollout
        self._queues: list | None = None

    def send(self, bucket_refs: Iterable, version: int, ranks: list[int] | None = None) -> None:
        """Stream ``bucket_refs`` into the engines ``ranks`` (those in service by default) as they come."""
        ranks = self.rollout.in_service() if ranks is None else ranks
        queues = self._engine_queues()
        calls = self.rollout.start(
            {rank: rank_call(RolloutWorker.receive_weights, queues[rank], version) for rank in ranks}
        )
        syncing = {rank: (queues[rank], ref) for rank, ref in zip(calls.ranks, calls.refs)}
        for ref in bucket_refs:
            self._push(syncing, [ref], version)  # wrapped: the engine fetches the bucket itself
        self._push(syncing, None, version)
        calls.ranks, calls.refs = list(syncing), [ref for _, ref in syncing.values()]
        self.rollout.synced(self.rollout.finish(calls, STAGE), version)

    def engine_replaced(self, rank: int) -> None:
        """A dead engine may have left buckets in its queue: it gets a new one."""
        if self._queues is not None:
            self._queues[rank].shutdown()
            self._queues[rank] = _new_queue()

    def _engine_queues(self) -> list:
        if self._queues is None:
            self._queues = [_new_queue() for _ in self.rollout.workers.workers]
        return self._queues

    def _push(self, syncing: dict[int, tuple[Any, Any]], item, version: int) -> None:
        """Put ``item`` on every syncing engine's queue; an engine that failed or stopped taking
        buckets for the call deadline is replaced and leaves the sync (``syncing`` shrinks)."""
        import ray
        from ray.util.queue import Full

        deadline = self.rollout.workers.call_deadline
        for rank in list(syncing):
            queue, pending = syncing[rank]
            waited = time.monotonic()
            while True:
                try:
                    queue.put(item, timeout=1.0)
                    break
                except Full:
                    done, _ = ray.wait([pending], timeout=0)
                    stuck = deadline.seconds is not None and time.monotonic() - waited > deadline.seconds
                    if done or stuck:
                        del syncing[rank]
                        self.rollout.replace(rank, self._failure(rank, version, pending if done else None), STAGE)
                        break

    def _failure(self, rank: int, version: int, finished) -> RemoteCallError:
        """Why engine ``rank`` left the weight sync: its own error, or its silence past the deadline."""
        workers = self.rollout.workers
        if finished is not None:
            error = workers.settle([finished], "receive_weights", [rank])[0]
            if isinstance(error, RemoteCallError):
                return error
            # it returned before the last bucket: a bug, not a failure to recover from
            raise RuntimeError(f"rollout engine {rank} finished its weight update (version {version}) early")
        deadline = workers.call_deadline
        return RemoteCallError(
            f"{workers.name}.receive_weights: rank(s) [{rank}] took no weight bucket within "
            f"{deadline.seconds:g} s ({deadline.key}) during the weight sync to version {version}"
        )


def _new_queue():
    from ray.util.queue import Queue

    return Queue(maxsize=BUCKETS_AHEAD, actor_options={"num_cpus": 0})
