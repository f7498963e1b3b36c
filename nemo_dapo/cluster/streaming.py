"""The engines as one stream (``trainer.mode=stream``): groups go to the engine with the fewest
groups outstanding (every group is ``rollout.n`` samples), finished groups come back from every
engine, and an engine that dies or hangs is replaced (the rollout group's restart budget), given
the current weights, and sent its outstanding groups again, so no prompt is lost.

A stream call (send groups, take finished ones, read the load) returns between two engine
steps, so an engine that has not answered within many of its slowest steps is hung, not busy:
the stream's calls wait :data:`SLOWEST_STEPS` x the slowest step any engine has taken (at least
``call_floor_s``, never past the rollout group's own call deadline) before replacing it, instead
of the hours a generation may take."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nemo_dapo.cluster.groups import RolloutGroup
from nemo_dapo.cluster.worker_group import Deadline, RankCall, rank_call
from nemo_dapo.rollout.base import RolloutWorker, SamplingSettings, StreamedGroup, StreamStats

log = logging.getLogger(__name__)
SLOWEST_STEPS = 10  # a stream call waits this many of the slowest engine step seen so far ...
CALL_FLOOR_S = 60.0  # ... and at least this long (an engine's first steps, a recompute after an update)


@dataclass
class Outstanding:
    """A group sent to an engine and not yet taken back."""

    rank: int
    prompt_ids: list[int]


class StreamingEngines:
    """The rollout group's engines as one stream for the streaming trainer: :meth:`add` sends
    groups, :meth:`take` returns the finished ones from every engine, :meth:`load` says how busy
    they were. It keeps which group each engine holds, so that an engine replaced anywhere (here,
    in a weight sync, in validation) gets its stream restarted and its groups sent again."""

    def __init__(
        self,
        rollout: RolloutGroup,
        sampling: SamplingSettings,
        max_inflight: int,
        kv_after_update: str,
        call_floor_s: float = CALL_FLOOR_S,
    ):
        self.rollout, self.sampling = rollout, sampling
        self.max_inflight, self.kv_after_update = max_inflight, kv_after_update
        self.call_floor_s = call_floor_s
        self.slowest_step_s = 0.0  # the slowest engine step reported so far
        self.outstanding: dict[str, Outstanding] = {}
        self.resent = 0  # groups sent again after their engine was replaced
        self._seen_restarts = list(rollout.workers.restarts)
        self._lost_seen: set[int] = set()
        self._start(rollout.in_service())

    def _start(self, ranks: list[int]) -> None:
        """Start streaming on ``ranks``; one that fails is replaced and started by the next look."""
        call = rank_call(RolloutWorker.start_stream, self.max_inflight, self.kv_after_update)
        self.rollout.fan_out(dict.fromkeys(ranks, call), "starting its stream")

    def add(self, groups: list[tuple[str, list[int]]]) -> None:
        """Send ``(key, prompt ids)`` groups, each to the engine with the fewest groups outstanding."""
        self._recover_replaced()
        per_rank: dict[int, list[tuple[str, list[int]]]] = {}
        load = dict.fromkeys(self.rollout.in_service(), 0)
        for sent in self.outstanding.values():
            if sent.rank in load:
                load[sent.rank] += 1
        for key, ids in groups:
            rank = min(load, key=load.__getitem__)
            load[rank] += 1
            per_rank.setdefault(rank, []).append((key, ids))
            self.outstanding[key] = Outstanding(rank, list(ids))
        self._send(per_rank)

    def _send(self, per_rank: dict[int, list[tuple[str, list[int]]]]) -> None:
        calls = {rank: rank_call(RolloutWorker.stream_add, groups, self.sampling) for rank, groups in per_rank.items()}
        self._fan_out(calls, self._deadline())

    def take(self, wait_s: float) -> list[StreamedGroup]:
        """Finished groups from every engine (each waits up to ``wait_s`` for its first)."""
        self._recover_replaced()
        finished = []
        taking = self._every(rank_call(RolloutWorker.stream_take, wait_s))
        for outcome in self._fan_out(taking, self._deadline(wait_s)).values():
            for group in outcome:
                if self.outstanding.pop(group.key, None) is not None:
                    finished.append(group)
        return finished

    def load(self) -> StreamStats:
        """Stepping, starved and wall time, running samples, queued groups and finished tokens since
        the last call, summed over the engines (what a replaced engine did since the last call is
        lost with it)."""
        self._recover_replaced()
        stats = self._fan_out(self._every(rank_call(RolloutWorker.stream_stats)), self._deadline())
        total = StreamStats.total(list(stats.values()))
        self.slowest_step_s = max(self.slowest_step_s, total.slowest_step_s)
        return total

    def _every(self, call: RankCall) -> dict[int, RankCall]:
        return dict.fromkeys(self.rollout.in_service(), call)

    def _fan_out(self, calls: dict[int, RankCall], deadline: Deadline) -> dict:
        """The rollout group's fan-out; an engine replaced on the way restarts its stream."""
        outcomes = self.rollout.fan_out(calls, "while streaming", deadline)
        if len(outcomes) < len(calls):
            self._recover_replaced()
        return outcomes

    def _recover_lost(self) -> None:
        """The groups of engines whose node was lost go to the engines left, as if newly admitted."""
        newly = self.rollout.lost - self._lost_seen
        self._lost_seen = set(self.rollout.lost)
        again = [(key, sent.prompt_ids) for key, sent in self.outstanding.items() if sent.rank in newly]
        if again:
            log.warning("rollout engine(s) %s lost while streaming: sending their %d groups to the others",
                        sorted(newly), len(again))  # fmt: skip
            self.resent += len(again)
            self.add(again)

    def _deadline(self, wait_s: float = 0.0) -> Deadline:
        """How long a stream call may take before its engine counts as hung (see the module)."""
        group = self.rollout.workers.call_deadline
        seconds = max(self.call_floor_s, SLOWEST_STEPS * self.slowest_step_s) + wait_s
        if group.seconds is not None and group.seconds <= seconds:
            return group
        return Deadline(
            seconds,
            f"a stream call: {SLOWEST_STEPS} x the slowest engine step so far, at least {self.call_floor_s:g} s",
        )

    def _recover_replaced(self) -> None:
        """Engines replaced or restored since the last look (here, during a weight sync or
        validation) get the current weights, start streaming, and are sent their outstanding groups
        again; lost engines' groups go to the others: every call that reaches the engines' streams
        looks first. An engine replaced again while it warms up
        is looked at again, so each engine starts one stream."""
        self._recover_lost()
        restarts = self.rollout.workers.restarts
        while replaced := [rank for rank, count in enumerate(restarts) if count != self._seen_restarts[rank]]:
            rank = replaced[0]
            self._seen_restarts[rank] = restarts[rank]
            if rank in self.rollout.lost:
                continue  # replaced, then its node was lost: nothing to start
            self.rollout.warm_up(rank)
            if restarts[rank] != self._seen_restarts[rank]:
                continue  # it failed its warm-up and was replaced: warm the new one
            self._start([rank])
            if restarts[rank] != self._seen_restarts[rank]:
                continue  # it failed to start streaming and was replaced: warm the new one
            again = [(key, sent.prompt_ids) for key, sent in self.outstanding.items() if sent.rank == rank]
            log.warning("rollout engine %d replaced while streaming: sending its %d groups again", rank, len(again))
            self.resent += len(again)
            if again:
                self._send({rank: again})
