"""The streaming trainer's staleness rules on its own books (trainer/stream_fit.py): admission
stops at AReaL's bound, and a group that finishes older than ``max_staleness`` versions is not
trained but counted and its prompt sent again first."""

from collections import deque

import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.trainer.stream_fit import KeptGroup, StreamDAPOTrainer
from nemo_dapo.trainer.tracking import StageTimer


class SentGroups:
    """Stands in for the engines' side: records what the driver sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[int]]] = []

    def add(self, groups) -> None:
        self.sent += groups


def books(weight_version: int, max_staleness: int, batch_groups: int) -> StreamDAPOTrainer:
    trainer = StreamDAPOTrainer.__new__(StreamDAPOTrainer)  # the bookkeeping alone, no workers
    trainer.weight_version = trainer.synced = weight_version
    trainer.max_staleness, trainer.batch_groups = max_staleness, batch_groups
    trainer.kept, trainer.to_issue, trainer.in_flight = [], deque(), {}
    trainer.issued = trainer.admitted = trainer.dropped_stale = trainer.reissued = 0
    trainer.engines = SentGroups()
    trainer.train_data = [{"prompt_ids": [row]} for row in range(100)]
    trainer._consumed = []
    trainer._next_prompt_indices = lambda: list(range(len(trainer._consumed), len(trainer._consumed) + 4))
    return trainer


def group(sequence: int, row: int, admitted_version: int) -> KeptGroup:
    batch = RolloutBatch(tensors={"prompt_index": torch.tensor([row, row])}, fields={"uid": [f"u{sequence}"] * 2})
    return KeptGroup(sequence, batch, admitted_version)


def test_admission_stops_at_the_staleness_bound():
    trainer = books(weight_version=0, max_staleness=1, batch_groups=3)
    trainer._admit()
    assert [key for key, _ in trainer.engines.sent] == [f"g{i}" for i in range(6)]  # (0 + 1 + 1) x 3
    trainer._admit()
    assert len(trainer.engines.sent) == 6  # no room until a sync or a filtered group
    trainer.synced, trainer.admitted = 1, 5  # one sync; one group filtered out
    trainer._admit()
    assert len(trainer.engines.sent) == 10 and trainer.admitted == 9


def test_a_group_older_than_max_staleness_is_dropped_counted_and_its_prompt_reissued_first():
    trainer = books(weight_version=3, max_staleness=1, batch_groups=2)
    trainer.admitted = 3
    trainer.to_issue.append(50)
    trainer.kept = [group(7, 40, admitted_version=1), group(9, 41, 2), group(8, 42, 3)]
    batch, _ = trainer._take_batch(StageTimer())
    assert batch["prompt_index"].tolist() == [42, 42, 41, 41]  # issue order among the fresh ones
    assert (trainer.dropped_stale, trainer.reissued, trainer.admitted) == (1, 1, 2)
    assert list(trainer.to_issue) == [40, 50] and trainer.kept == []
