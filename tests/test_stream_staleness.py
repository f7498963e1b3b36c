"""The streaming trainer's staleness rules on its own books (trainer/stream_fit.py): admission
stops at AReaL's bound, and a group that finishes older than ``max_staleness`` versions is not
trained but counted and its prompt sent again first. The books hold a real dataset whose first
row was filtered out at load (too long), so a dataset position is one less than its row id:
what is sent again, and what a checkpoint keeps, must be the row drawn."""

from collections import deque

import pytest
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


@pytest.fixture(scope="module")
def dataset(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    from nemo_dapo.data.dataset import RLDataset
    from tests.train_runs import with_an_overlong_first_prompt

    path = with_an_overlong_first_prompt(tiny_model_dir, tmp_path_factory.mktemp("data"))
    data = RLDataset(path, tiny_tokenizer, max_prompt_length=64, filter_overlong_prompts=True)
    assert [data.row_id(p) for p in (0, 40)] == [1, 41]
    return data


def books(dataset, weight_version: int, max_staleness: int, batch_groups: int) -> StreamDAPOTrainer:
    trainer = StreamDAPOTrainer.__new__(StreamDAPOTrainer)  # the bookkeeping alone, no workers
    trainer.weight_version = trainer.synced = weight_version
    trainer.max_staleness, trainer.batch_groups = max_staleness, batch_groups
    trainer.kept, trainer.to_issue, trainer.in_flight = [], deque(), {}
    trainer.issued = trainer.admitted = trainer.dropped_stale = trainer.reissued = 0
    trainer.drop_surplus, trainer._surplus_rows, trainer._filtered_rows = False, [], []
    trainer.engines = SentGroups()
    trainer.train_data = dataset
    trainer._consumed = []
    trainer._next_prompt_indices = lambda: list(range(len(trainer._consumed), len(trainer._consumed) + 4))
    return trainer


def group(dataset, sequence: int, position: int, admitted_version: int) -> KeptGroup:
    row = dataset.row_id(position)
    batch = RolloutBatch(tensors={"prompt_index": torch.tensor([row, row])}, fields={"uid": [f"u{sequence}"] * 2})
    return KeptGroup(sequence, batch, admitted_version, position)


def test_admission_stops_at_the_staleness_bound(dataset):
    trainer = books(dataset, weight_version=0, max_staleness=1, batch_groups=3)
    trainer._admit()
    assert [key for key, _ in trainer.engines.sent] == [f"g{i}" for i in range(6)]  # (0 + 1 + 1) x 3
    assert [ids for _, ids in trainer.engines.sent] == [dataset[p]["prompt_ids"] for p in range(6)]
    assert trainer._consumed == list(range(1, 9))  # row ids (two draws of 4); row 0 is not in the data
    trainer._admit()
    assert len(trainer.engines.sent) == 6  # no room until a sync or a filtered group
    trainer.synced, trainer.admitted = 1, 5  # one sync; one group filtered out
    trainer._admit()
    assert len(trainer.engines.sent) == 10 and trainer.admitted == 9


def test_a_group_older_than_max_staleness_is_dropped_counted_and_its_prompt_reissued_first(dataset):
    trainer = books(dataset, weight_version=3, max_staleness=1, batch_groups=2)
    trainer.admitted = 3
    trainer.to_issue.append(50)
    trainer.kept = [group(dataset, 7, 40, admitted_version=1), group(dataset, 9, 41, 2), group(dataset, 8, 42, 3)]
    batch, _ = trainer._next_batch(StageTimer())
    assert batch["prompt_index"].tolist() == [43, 43, 42, 42]  # issue order among the fresh ones (row ids)
    assert (trainer.dropped_stale, trainer.reissued, trainer.admitted) == (1, 1, 2)
    assert list(trainer.to_issue) == [40, 50] and trainer.kept == []  # positions: row 41 goes again
    assert trainer._untrained_rows() == [41, 51]  # what a checkpoint keeps: row ids
    trainer._admit()  # the dropped prompt is sent again first: row 41's prompt, not a new draw
    assert trainer.engines.sent[0][1] == dataset[40]["prompt_ids"] == dataset[dataset.position_of(41)]["prompt_ids"]
    assert trainer._consumed == list(range(1, 9))  # the new draws after rows 41 and 51


def test_carry_over_false_drops_the_groups_finished_beyond_the_batch_and_frees_their_slots(dataset):
    """filter_groups.carry_over=false: the batch takes the first-issued groups; the rest already
    finished are dropped, counted and named by row id, and their slots admit new prompts. With
    carry-over (the stream's default) they start the next batch."""
    for drop in (True, False):
        trainer = books(dataset, weight_version=1, max_staleness=1, batch_groups=2)
        trainer.drop_surplus, trainer.admitted = drop, 4
        trainer.kept = [group(dataset, s, 40 + s, admitted_version=1) for s in (3, 1, 2, 0)]
        batch, metrics = trainer._next_batch(StageTimer())
        assert batch["prompt_index"].tolist() == [41, 41, 42, 42]  # sequences 0 and 1 (row = position + 1)
        if drop:
            assert metrics["dapo/surplus_groups"] == 2 and trainer._surplus_rows == [43, 44]
            assert trainer.kept == [] and trainer.admitted == 2
            assert trainer._prompts_of_step()[1] == {"filtered": [], "surplus": [43, 44]}
        else:
            assert "dapo/surplus_groups" not in metrics and [g.sequence for g in trainer.kept] == [2, 3]
            assert trainer.admitted == 4 and trainer._prompts_of_step()[1] == {"filtered": []}


def test_a_checkpoint_keeps_untrained_rows_by_id_and_a_resume_issues_those_rows(dataset):
    """In flight, kept and waiting rows, checkpointed as row ids and issued again, in issue order,
    as the same dataset rows; a row the data no longer holds is refused naming the change."""
    from nemo_dapo.data.records import DatasetError

    trainer = books(dataset, weight_version=2, max_staleness=1, batch_groups=2)
    trainer.in_flight = {"g5": (5, 30), "g3": (3, 10)}
    trainer.kept = [group(dataset, 4, 20, admitted_version=2)]
    trainer.to_issue = deque([60])
    saved = trainer._untrained_rows()
    assert saved == [11, 21, 31, 61]
    resumed = books(dataset, weight_version=2, max_staleness=1, batch_groups=2)
    resumed._restore_untrained(saved)
    assert list(resumed.to_issue) == [10, 20, 30, 60]
    with pytest.raises(DatasetError, match=r"row 0 of the data files is not in this dataset"):
        resumed._restore_untrained([0])
