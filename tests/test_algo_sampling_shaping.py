"""Dynamic sampling (docs/algorithm.md §6), overlong shaping (docs/algorithm.md §5) and the RolloutBatch container."""

import pytest
import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.sampling import DynamicSamplingExhausted, GroupAccumulator, filter_metric, group_keep_mask
from nemo_dapo.algo.shaping import overlong_penalty


@pytest.mark.parametrize(
    "length,expected",
    [
        (10, 0.0),
        (16, 0.0),  # below / at the start of the buffer (max 20, buffer 4)
        (17, -0.25),
        (18, -0.5),
        (19, -0.75),  # inside: linear
        (20, -1.0),  # at max_response_length
    ],
)
def test_overlong_penalty(length, expected):
    assert overlong_penalty(torch.tensor([length]), 20, 4, 1.0).item() == pytest.approx(expected)


def test_overlong_penalty_factor_scales():
    assert overlong_penalty(torch.tensor([18]), 20, 4, 0.5).item() == pytest.approx(-0.25)


@pytest.mark.parametrize("buffer", [0, -3, 21])
def test_overlong_bad_buffer_rejected(buffer):
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_penalty(torch.tensor([5]), 20, buffer, 1.0)


def make_round(groups: dict, width=4, tag=0):
    """A generation round: group id -> list of acc values (one row per response)."""
    uids, accs = [], []
    for gid, values in groups.items():
        uids += [gid] * len(values)
        accs += values
    n = len(uids)
    return RolloutBatch(
        {"responses": torch.arange(n * width).reshape(n, width) + 1000 * tag}, {"uid": uids, "acc": accs}
    )


def test_keep_mask_population_std_and_singletons():
    keep, kept = group_keep_mask(["a", "a", "b", "b", "c"], torch.tensor([1, 0, 1, 1, 0]))
    assert keep.tolist() == [True, True, False, False, True]
    assert kept == ["a", "c"]


def test_accumulator_refills_across_rounds_and_cuts_whole_groups():
    acc = GroupAccumulator(target_groups=3, max_num_gen_batches=5)
    acc.add_round(make_round({"a": [1, 0], "b": [1, 1], "c": [0, 0]}))
    assert not acc.is_full() and acc.held_groups == 1
    acc.check_limit()
    acc.add_round(make_round({"d": [1, 0], "e": [0, 1], "f": [0, 1]}, tag=1))
    assert acc.is_full()
    batch = acc.pop_batch()
    assert batch["uid"] == ["a", "a", "d", "d", "e", "e"]
    assert batch["responses"].shape == (6, 4)
    metrics = acc.last_metrics
    assert metrics["dapo/num_gen_batches"] == 2
    assert metrics["dapo/kept_group_fraction"] == pytest.approx(4 / 6)
    assert metrics["dapo/round_0_kept_fraction"] == pytest.approx(1 / 3)
    assert metrics["dapo/round_1_kept_fraction"] == pytest.approx(1.0)
    assert metrics["dapo/surplus_groups"] == 1
    # surplus (group f) discarded by default
    acc.add_round(make_round({"g": [1, 1]}))
    assert acc.held_groups == 0


def test_carry_over_keeps_surplus_for_next_step_and_survives_state_dict():
    acc = GroupAccumulator(target_groups=2, carry_over=True)
    acc.add_round(make_round({"a": [1, 0], "b": [0, 1], "c": [1, 0]}))
    assert acc.pop_batch()["uid"] == ["a", "a", "b", "b"]
    assert acc.held_groups == 1
    restored = GroupAccumulator(target_groups=2, carry_over=True)
    restored.load_state_dict(acc.state_dict())
    restored.add_round(make_round({"d": [1, 0]}, tag=1))
    batch = restored.pop_batch()
    assert batch["uid"] == ["c", "c", "d", "d"]
    assert restored.last_metrics["dapo/carried_in_groups"] == 1


def test_groups_carried_by_a_checkpoint_without_a_loss_mask_get_one():
    """A checkpoint written before batches were built with ``loss_mask``: the carried groups get
    every response token as theirs, so they concatenate with the new rounds."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    carried = {"tensors": {"response_mask": mask}, "fields": {"uid": ["c", "c"], "acc": [1, 0]}, "meta": {}}
    acc = GroupAccumulator(target_groups=1, carry_over=True)
    acc.load_state_dict({"carried": carried})
    assert torch.equal(acc.state_dict()["carried"]["tensors"]["loss_mask"], mask)


def test_limit_raises_naming_the_knobs():
    acc = GroupAccumulator(target_groups=2, max_num_gen_batches=2)
    for _ in range(2):
        acc.add_round(make_round({"x": [1, 1], "y": [0, 0]}))
    with pytest.raises(DynamicSamplingExhausted, match="max_num_gen_batches=2.*gen_batch_size"):
        acc.check_limit()


def test_unbounded_when_max_non_positive():
    acc = GroupAccumulator(target_groups=1, max_num_gen_batches=0)
    for _ in range(50):
        acc.add_round(make_round({"x": [1, 1]}))
        acc.check_limit()
    assert acc.num_gen_batches == 50


def test_filter_metrics_by_name():
    batch = make_round({"a": [1, 0]})
    batch.add("token_level_scores", torch.tensor([[0.0, 1.0], [0.0, -1.0]]))
    assert filter_metric(batch, "seq_reward").tolist() == [1.0, -1.0]
    assert filter_metric(batch, "seq_final_reward").tolist() == [1.0, -1.0]  # no KL term before the filter
    assert filter_metric(batch, "acc").tolist() == [1.0, 0.0]
    with pytest.raises(KeyError, match="filter_groups.metric"):
        filter_metric(batch, "nope")


def test_batch_add_refuses_rewrite_and_concat_pads():
    a = RolloutBatch({"responses": torch.ones(1, 2), "prompts": torch.ones(1, 3)}, {"uid": ["a"]})
    b = RolloutBatch({"responses": torch.ones(1, 4), "prompts": torch.ones(1, 1)}, {"uid": ["b"]})
    with pytest.raises(KeyError, match="do not rewrite"):
        a.add("responses", torch.zeros(1, 2))
    both = RolloutBatch.concat([a, b])
    assert both["responses"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]  # right padded
    assert both["prompts"].tolist() == [[1, 1, 1], [0, 0, 1]]  # left padded
    with pytest.raises(ValueError, match="disagree"):
        RolloutBatch({"x": torch.ones(2)}, {"uid": ["a"]})
