"""The engines as one stream (``trainer.mode=stream``): groups go to the engine with the fewest
groups outstanding (every group is ``rollout.n`` samples), finished groups come back from every
engine, and an engine that dies or hangs is replaced (the rollout group's restart budget), given
the current weights, and sent its outstanding groups again, so no prompt is lost."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nemo_dapo.cluster.groups import RolloutGroup
from nemo_dapo.errors import RemoteCallError
from nemo_dapo.rollout.base import SamplingSettings, StreamedGroup, StreamStats

log = logging.getLogger(__name__)


@dataclass
class Outstanding:
    """A group sent to an engine and not yet taken back."""

    rank: int
    prompt_ids: list[int]


class StreamingEngines:
    def __init__(self, rollout: RolloutGroup, sampling: SamplingSettings, max_inflight: int, kv_after_update: str):
        self.rollout, self.sampling = rollout, sampling
        self.max_inflight, self.kv_after_update = max_inflight, kv_after_update
        self.outstanding: dict[str, Outstanding] = {}
        self.resent = 0  # groups sent again after their engine was replaced
        self._seen_restarts = list(rollout.workers.restarts)
        self._start(list(range(rollout.workers.world_size)))

    def _start(self, ranks: list[int]) -> None:
        workers = self.rollout.workers
        refs = [workers.workers[r].start_stream.remote(self.max_inflight, self.kv_after_update) for r in ranks]
        workers.gather(refs, "start_stream")

    def add(self, groups: list[tuple[str, list[int]]]) -> None:
        """Send ``(key, prompt ids)`` groups, each to the engine with the fewest groups outstanding."""
        per_rank: dict[int, list[tuple[str, list[int]]]] = {}
        load = [0] * self.rollout.workers.world_size
        for sent in self.outstanding.values():
            load[sent.rank] += 1
        for key, ids in groups:
            rank = load.index(min(load))
            load[rank] += 1
            per_rank.setdefault(rank, []).append((key, ids))
            self.outstanding[key] = Outstanding(rank, list(ids))
        self._send(per_rank)

    def _send(self, per_rank: dict[int, list[tuple[str, list[int]]]]) -> None:
        workers = self.rollout.workers
        ranks = list(per_rank)
        refs = [workers.workers[r].stream_add.remote(per_rank[r], self.sampling) for r in ranks]
        for rank, outcome in zip(ranks, workers.settle(refs, "stream_add", ranks)):
            if isinstance(outcome, RemoteCallError):
                self._recover(rank, outcome)

    def take(self, wait_s: float) -> list[StreamedGroup]:
        """Finished groups from every engine (each waits up to ``wait_s`` for its first)."""
        self._recover_replaced()
        workers = self.rollout.workers
        ranks = list(range(workers.world_size))
        refs = [workers.workers[r].stream_take.remote(wait_s) for r in ranks]
        finished = []
        for rank, outcome in zip(ranks, workers.settle(refs, "stream_take", ranks)):
            if isinstance(outcome, RemoteCallError):
                self._recover(rank, outcome)
                continue
            for group in outcome:
                if self.outstanding.pop(group.key, None) is not None:
                    finished.append(group)
        return finished

    def load(self) -> StreamStats:
        """Stepping, starved and wall time, running samples, queued groups and finished tokens since
        the last call, summed over the engines."""
        return StreamStats.total(self.rollout.workers.call_all("stream_stats"))

    def _recover(self, rank: int, error: RemoteCallError) -> None:
        self.rollout.replace(rank, error, "while streaming")
        self._recover_replaced()

    def _recover_replaced(self) -> None:
        """Engines replaced since the last look (here or during a weight sync) get the current
        weights, start streaming, and are sent their outstanding groups again."""
        restarts = self.rollout.workers.restarts
        replaced = [rank for rank, count in enumerate(restarts) if count != self._seen_restarts[rank]]
        self._seen_restarts = list(restarts)
        for rank in replaced:
            self.rollout.warm_up(rank)
            self._start([rank])
            again = [(key, sent.prompt_ids) for key, sent in self.outstanding.items() if sent.rank == rank]
            log.warning("rollout engine %d replaced while streaming: sending its %d groups again", rank, len(again))
            self.resent += len(again)
            if again:
                self._send({rank: again})
