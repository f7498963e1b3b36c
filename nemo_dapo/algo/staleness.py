"""The streaming mode's books (docs/algorithm.md §8, "Streaming"): which prompts may enter the
engines, which finished groups a step trains, and which prompts go again. Pure bookkeeping over
dataset positions: no engine, no trainer (the model is AReaL's staleness manager).

1. admission: a prompt (a group of ``rollout.n`` samples) enters while fewer than
   ``(syncs + max_staleness + 1) x batch_groups`` groups count as admitted: a group's first token
   then lags the policy that trains on it by at most ``max_staleness`` versions, unless it
   finishes later than groups admitted after it. A group filtered out, dropped as stale or
   dropped as surplus stops counting: its slot goes to the next prompt.
2. a step takes the ``batch_groups`` kept groups issued first; a kept group older than
   ``max_staleness`` versions is not trained, counted, and its prompt issued again first.
3. what a checkpoint keeps: every position drawn and not trained (in flight, kept, waiting), in
   issue order; a resumed run issues them first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nemo_dapo.algo.batch import RolloutBatch


@dataclass
class KeptGroup:
    """A finished, scored group waiting for a step: its rows and its place in issue order."""

    sequence: int
    batch: RolloutBatch
    admitted_version: int
    position: int  # the prompt's place in the dataset


class StreamBooks:
    """The counters and queues of the streaming mode (see the module's rules)."""

    def __init__(self, batch_groups: int, max_staleness: int, drop_surplus: bool) -> None:
        self.batch_groups, self.max_staleness, self.drop_surplus = batch_groups, max_staleness, drop_surplus
        self.issued = 0  # sequence number of the next prompt sent (its group key is g<sequence>)
        self.admitted = 0  # groups admitted since the start, less those filtered or dropped
        self.synced = 0  # weight syncs since the start: the bound's version
        self.in_flight: dict[str, tuple[int, int]] = {}  # group key -> (sequence, dataset position)
        self.kept: list[KeptGroup] = []
        self.to_issue: deque[int] = deque()  # dataset positions to send before drawing new ones
        self.filtered = self.dropped_stale = self.reissued = 0
        self.filtered_positions: list[int] = []  # dropped by dynamic sampling since the last record
        self.surplus_positions: list[int] = []  # finished beyond a batch and dropped, likewise

    def admit(self, draw: Callable[[], list[int]]) -> list[tuple[str, int]]:
        """The groups (key, dataset position) the bound has room for: positions to issue again
        first, then new draws."""
        room = (self.synced + self.max_staleness + 1) * self.batch_groups - self.admitted
        sent = []
        for _ in range(max(room, 0)):
            if not self.to_issue:
                self.to_issue.extend(draw())
            position, key = self.to_issue.popleft(), f"g{self.issued}"
            self.in_flight[key] = (self.issued, position)
            self.issued += 1
            sent.append((key, position))
        self.admitted += len(sent)
        return sent

    def arrived(self, key: str) -> tuple[int, int]:
        """A group finished: its (sequence, dataset position)."""
        return self.in_flight.pop(key)

    def keep(self, group: KeptGroup) -> None:
        self.kept.append(group)

    def filter_out(self, position: int) -> None:
        """Dynamic sampling dropped the group: its slot goes to the next prompt."""
        self.filtered_positions.append(position)
        self.filtered += 1
        self.admitted -= 1

    def drop_stale(self, weight_version: int) -> None:
        """Kept groups older than ``max_staleness`` versions go; the rest in issue order."""
        fresh: list[KeptGroup] = []
        for group in self.kept:
            if weight_version - group.admitted_version <= self.max_staleness:
                fresh.append(group)
            else:  # finished after groups admitted later: not trained, its prompt issued again first
                self.dropped_stale += 1
                self.reissued += 1
                self.admitted -= 1
                self.to_issue.appendleft(group.position)
        self.kept = sorted(fresh, key=lambda g: g.sequence)

    def full(self) -> bool:
        return len(self.kept) >= self.batch_groups

    def take(self) -> list[KeptGroup]:
        """The step's groups: the first ``batch_groups`` kept (call :meth:`drop_stale` first)."""
        taken, self.kept = self.kept[: self.batch_groups], self.kept[self.batch_groups :]
        return taken

    def drop_kept_surplus(self) -> int:
        """``filter_groups.carry_over=false``: the groups finished beyond the batch are not
        trained; their slots go to new prompts. Returns how many went."""
        dropped = len(self.kept)
        self.surplus_positions += [group.position for group in self.kept]
        self.admitted -= dropped
        self.kept = []
        return dropped

    def synced_once(self) -> None:
        self.synced += 1

    def take_dropped(self) -> tuple[list[int], list[int]]:
        """The positions filtered out and dropped as surplus since the last call."""
        dropped = (self.filtered_positions, self.surplus_positions)
        self.filtered_positions, self.surplus_positions = [], []
        return dropped

    def untrained_positions(self) -> list[int]:
        """The positions drawn and not trained, in issue order: in flight, kept, not yet sent."""
        waiting = sorted(self.in_flight.values()) + [(g.sequence, g.position) for g in self.kept]
        return [position for _, position in sorted(waiting)] + list(self.to_issue)

    def restore(self, global_step: int, untrained: list[int]) -> None:
        """Every step trained ``batch_groups`` groups: so many were admitted and count against the
        bound; the positions drawn and not trained are issued first."""
        self.synced = global_step
        self.admitted = global_step * self.batch_groups
        self.to_issue = deque(untrained)
        self.reissued = len(self.to_issue)
