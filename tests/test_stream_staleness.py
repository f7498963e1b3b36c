"""The streaming mode's staleness rules on their own books (algo/staleness.py), and the stream
source's names for what they hold (trainer/stream_source.py): admission stops at AReaL's bound,
and a group that finishes older than ``max_staleness`` versions is not trained but counted and
its prompt sent again first. The source holds a real dataset whose first row was filtered out at
load (too long), so a dataset position is one less than its row id: what is sent again, and what
a checkpoint keeps, must be the row drawn."""

import pytest
import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.staleness import KeptGroup, StreamBooks
from nemo_dapo.trainer.source import StepPlace
from nemo_dapo.trainer.tracking import StageTimer


class SentGroups:
    """Stands in for the engines' side: records what the driver sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[int]]] = []

    def add(self, groups) -> None:
        self.sent += groups

    def load(self) -> None:
        """The busy clock's start: nothing to count here."""


def counting_draws():
    """A sampler in dataset order, four positions a draw."""
    drawn = []

    def draw() -> list[int]:
        drawn.extend(range(len(drawn), len(drawn) + 4))
        return drawn[-4:]

    return draw


def kept(sequence: int, position: int, admitted_version: int, row: int | None = None) -> KeptGroup:
    row = position + 1 if row is None else row
    batch = RolloutBatch(tensors={"prompt_index": torch.tensor([row, row])}, fields={"uid": [f"u{sequence}"] * 2})
    return KeptGroup(sequence, batch, admitted_version, position)


def test_admission_stops_at_the_staleness_bound():
    books, draw = StreamBooks(batch_groups=3, max_staleness=1, drop_surplus=False), counting_draws()
    assert books.admit(draw) == [(f"g{i}", i) for i in range(6)]  # (0 syncs + 1 + 1) x 3 groups
    assert books.admit(draw) == []  # no room until a sync or a filtered group
    books.synced_once()
    books.filter_out(books.arrived("g5")[1])  # its slot goes to the next prompt
    assert books.admit(draw) == [(f"g{i}", i) for i in range(6, 10)] and books.admitted == 9
    assert books.untrained_positions() == [0, 1, 2, 3, 4, *range(6, 12)]  # in flight, then drawn and waiting


def test_a_group_older_than_max_staleness_is_dropped_counted_and_its_prompt_issued_again_first():
    books = StreamBooks(batch_groups=2, max_staleness=1, drop_surplus=False)
    books.admitted = 3
    books.to_issue.append(50)
    for group in (kept(7, 40, admitted_version=1), kept(9, 41, 2), kept(8, 42, 3)):
        books.keep(group)
    books.drop_stale(weight_version=3)
    assert books.full() and [g.sequence for g in books.take()] == [8, 9]  # issue order among the fresh ones
    assert (books.dropped_stale, books.reissued, books.admitted) == (1, 1, 2)
    assert list(books.to_issue) == [40, 50] and books.kept == []
    assert books.admit(counting_draws())[0] == ("g0", 40)  # the dropped prompt goes first, not a new draw


@pytest.mark.parametrize("drop", [True, False])
def test_carry_over_false_drops_the_groups_finished_beyond_the_batch_and_frees_their_slots(drop):
    """filter_groups.carry_over=false: the batch takes the first-issued groups; the rest already
    finished are dropped and counted, and their slots admit new prompts. With carry-over (the
    stream's default) they start the next batch."""
    books = StreamBooks(batch_groups=2, max_staleness=1, drop_surplus=drop)
    books.admitted = 4
    for sequence in (3, 1, 2, 0):
        books.keep(kept(sequence, 40 + sequence, admitted_version=1))
    books.drop_stale(weight_version=1)
    assert [g.sequence for g in books.take()] == [0, 1]
    if drop:
        assert books.drop_kept_surplus() == 2 and books.admitted == 2 and books.kept == []
        assert books.take_dropped() == ([], [42, 43]) and books.take_dropped() == ([], [])
    else:
        assert [g.sequence for g in books.kept] == [2, 3] and books.admitted == 4


@pytest.fixture(scope="module")
def dataset(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    from nemo_dapo.data.dataset import RLDataset
    from tests.train_runs import with_an_overlong_first_prompt

    path = with_an_overlong_first_prompt(tiny_model_dir, tmp_path_factory.mktemp("data"))
    data = RLDataset(path, tiny_tokenizer, max_prompt_length=64, filter_overlong_prompts=True)
    assert [data.row_id(p) for p in (0, 40)] == [1, 41]
    return data


def source(dataset, *overrides: str):
    from nemo_dapo.config import load_config
    from nemo_dapo.data import ResumableBatchSampler
    from nemo_dapo.trainer.source import PromptDraws
    from nemo_dapo.trainer.stream_source import StreamSource

    cfg = load_config(
        "tiny_cpu", ["trainer.mode=stream", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", *overrides]
    )
    draws = PromptDraws(ResumableBatchSampler(len(dataset), 4, shuffle=False), dataset.row_id)
    return StreamSource(cfg, draws, dataset, SentGroups(), tokenizer=None, reward=None)


def test_the_source_sends_and_records_rows_by_id_and_a_stale_row_goes_again(dataset):
    stream = source(dataset, "trainer.max_staleness=1")
    stream._admit()  # (0 + 1 + 1) x 2 groups
    assert [ids for _, ids in stream.engines.sent] == [dataset[p]["prompt_ids"] for p in range(4)]
    assert stream.draws.consumed == [1, 2, 3, 4]  # row ids; row 0 is not in the data
    stream.books.in_flight.clear()
    stream.books.keep(kept(7, 40, admitted_version=0))  # two versions old by the sync below
    stream.books.keep(kept(8, 41, admitted_version=2))
    stream.books.keep(kept(9, 42, admitted_version=2))
    batch, _ = stream.next_batch(StepPlace(2, 2, lambda: False), StageTimer())
    assert batch["prompt_index"].tolist() == [42, 42, 43, 43]
    assert stream.state()["stream_untrained"] == [41]  # what a checkpoint keeps: row ids


def test_a_checkpoint_keeps_untrained_rows_by_id_and_a_resume_issues_those_rows(dataset):
    """In flight, kept and waiting rows, checkpointed as row ids and issued again, in issue order,
    as the same dataset rows; a row the data no longer holds is refused naming the change."""
    from nemo_dapo.data.records import DatasetError

    stream = source(dataset, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.carry_over=false")
    stream.books.in_flight = {"g5": (5, 30), "g3": (3, 10)}
    stream.books.keep(kept(4, 20, admitted_version=2))
    stream.books.to_issue.append(60)
    stream.books.filter_out(70)
    saved = stream.state()
    assert saved["stream_untrained"] == [11, 21, 31, 61] and saved["accumulator"] is None
    assert stream.prompts_of_step() == ([], {"filtered": [71], "surplus": []})
    resumed = source(dataset)
    resumed.restore(saved, global_step=2)
    assert list(resumed.books.to_issue) == [10, 20, 30, 60] and resumed.books.reissued == 4
    assert (resumed.books.synced, resumed.books.admitted) == (2, 4)
    with pytest.raises(DatasetError, match=r"row 0 of the data files is not in this dataset"):
        resumed.restore({**saved, "stream_untrained": [0]}, global_step=2)
