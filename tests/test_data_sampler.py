"""The batch sampler must be seeded, drop the ragged tail, and resume exactly from a checkpoint."""

import pytest

from nemo_dapo.data import ResumableBatchSampler

DATASET_SIZE = 23
BATCH_SIZE = 4  # 5 batches per epoch, 3 indices dropped each epoch


def take_batches(sampler: ResumableBatchSampler, count: int) -> list[list[int]]:
    """Hand out ``count`` batches, crossing epochs the way a training loop would (one ``for`` per epoch)."""
    batches: list[list[int]] = []
    while len(batches) < count:
        for batch in sampler:
            batches.append(batch)
            if len(batches) == count:
                break
    return batches


def test_each_epoch_is_a_seeded_permutation_without_the_tail():
    sampler = ResumableBatchSampler(DATASET_SIZE, BATCH_SIZE, seed=3)
    assert len(sampler) == 5
    epoch_0 = list(sampler)
    epoch_1 = list(sampler)
    for epoch in (epoch_0, epoch_1):
        assert len(epoch) == 5 and all(len(batch) == BATCH_SIZE for batch in epoch)
        flat = [index for batch in epoch for index in batch]
        assert len(set(flat)) == 20 and set(flat) <= set(range(DATASET_SIZE))
    assert epoch_0 != epoch_1
    assert list(ResumableBatchSampler(DATASET_SIZE, BATCH_SIZE, seed=3)) == epoch_0
    assert list(ResumableBatchSampler(DATASET_SIZE, BATCH_SIZE, seed=4)) != epoch_0
    assert sampler.state_dict() == {"epoch": 2, "position": 0, "seed": 3}


def test_unshuffled_batches_are_in_order():
    sampler = ResumableBatchSampler(10, 3, shuffle=False)
    assert list(sampler) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert list(sampler) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 5, 6, 9, 10, 11])
def test_resume_yields_exactly_the_remaining_batches(stop_after):
    total = 15  # three epochs
    reference = take_batches(ResumableBatchSampler(DATASET_SIZE, BATCH_SIZE, seed=11), total)

    first_run = ResumableBatchSampler(DATASET_SIZE, BATCH_SIZE, seed=11)
    before = take_batches(first_run, stop_after)
    state = first_run.state_dict()
    assert state["epoch"] * 5 + state["position"] == stop_after

    resumed = ResumableBatchSampler(DATASET_SIZE, BATCH_SIZE, seed=999)  # the seed comes from the checkpoint
    resumed.load_state_dict(state)
    after = take_batches(resumed, total - stop_after)
    assert before + after == reference


def test_resume_mid_epoch_completes_that_epoch_only():
    sampler = ResumableBatchSampler(DATASET_SIZE, BATCH_SIZE, seed=0)
    take_batches(sampler, 7)  # epoch 1, two batches in
    resumed = ResumableBatchSampler(DATASET_SIZE, BATCH_SIZE, seed=0)
    resumed.load_state_dict(sampler.state_dict())
    rest_of_epoch = list(resumed)
    assert len(rest_of_epoch) == 3
    assert resumed.state_dict() == {"epoch": 2, "position": 0, "seed": 0}


def test_load_state_dict_validates():
    sampler = ResumableBatchSampler(DATASET_SIZE, BATCH_SIZE)
    with pytest.raises(ValueError, match="outside an epoch of 5 batches"):
        sampler.load_state_dict({"epoch": 0, "position": 6, "seed": 0})
    with pytest.raises(KeyError, match="seed"):
        sampler.load_state_dict({"epoch": 0, "position": 1})


def test_rejects_dataset_smaller_than_a_batch():
    with pytest.raises(ValueError, match="no full batch"):
        ResumableBatchSampler(3, 4)
