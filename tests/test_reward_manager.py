"""RewardManager: task score + overlong shaping, per-sample extras, token-level placement."""

import pytest
import torch

from nemo_dapo.reward import scorers
from nemo_dapo.reward.manager import RewardManager, RewardResult, token_level_rewards

MAX_LEN, BUFFER, FACTOR = 20, 8, 0.5  # penalty starts after 12 tokens, reaches -0.5 at 20


def _expected_penalty(length):
    """docs/algorithm.md §5 written out independently of the implementation."""
    return min(-(length - (MAX_LEN - BUFFER)) / BUFFER * FACTOR, 0.0)


@pytest.fixture
def manager():
    with RewardManager(
        "math_dapo",
        max_response_length=MAX_LEN,
        overlong_enable=True,
        buffer_len=BUFFER,
        penalty_factor=FACTOR,
    ) as shaped:
        yield shaped


def test_overlong_shaping_below_inside_and_at_end_of_buffer(manager):
    lengths = [5, 12, 13, 16, 20]
    responses = ["Answer: 4", "Answer: 4", "Answer: 5", "Answer: 4", "no answer, cut off"]
    result = manager.score(responses, ["4"] * 5, ["math_dapo"] * 5, lengths)
    penalties = [0.0, 0.0, -0.0625, -0.25, -0.5]
    assert penalties == [_expected_penalty(n) for n in lengths]
    task = [1.0, 1.0, -1.0, 1.0, -1.0]
    assert result.scores.dtype == torch.float32 and result.scores.shape == (5,)
    assert result.scores.tolist() == [t + p for t, p in zip(task, penalties, strict=True)]
    extras = result.extras
    assert extras["overlong_reward"].tolist() == penalties
    assert extras["score"].tolist() == result.scores.tolist()
    assert extras["acc"].tolist() == [True, True, False, True, False]
    assert extras["pred"] == ["4", "4", "5", "4", ""]
    assert extras["overlong"].tolist() == [False, False, False, False, True]
    assert extras["timeout"].tolist() == [False] * 5
    assert extras["data_source"] == ["math_dapo"] * 5


def test_shaping_off_gives_zero_penalty_but_still_flags_truncation():
    with RewardManager("math_dapo", max_response_length=MAX_LEN) as plain:
        result = plain.score(["Answer: 1", "Answer: 2"], ["1", "1"], ["a", "b"], torch.tensor([19, 20]))
    assert result.extras["overlong_reward"].tolist() == [0.0, 0.0]
    assert result.scores.tolist() == [1.0, -1.0]
    assert result.extras["overlong"].tolist() == [False, True]


def test_penalty_factor_scales_the_ramp():
    with RewardManager(
        "math_dapo", max_response_length=100, overlong_enable=True, buffer_len=40, penalty_factor=2.0
    ) as steep:
        result = steep.score(["Answer: 1"] * 3, ["1"] * 3, ["s"] * 3, [60, 70, 100])
    assert result.extras["overlong_reward"].tolist() == [0.0, -0.5, -2.0]
    assert result.scores.tolist() == [1.0, 0.5, -1.0]


def test_token_level_rewards_sit_on_the_last_valid_token():
    mask = torch.tensor(
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],  # nothing valid: all zeros whatever the score
            [1, 0, 1, 0, 0],  # holes (e.g. tool output) do not move it
        ]
    )
    scores = torch.tensor([1.0, -1.0, 0.5, -0.25])
    rewards = token_level_rewards(scores, mask)
    expected = torch.zeros(4, 5)
    expected[0, 2], expected[1, 4], expected[3, 2] = 1.0, -1.0, -0.25
    assert rewards.dtype == torch.float32
    assert torch.equal(rewards, expected)
    assert torch.equal(RewardResult(scores=scores).token_level_rewards(mask.bool()), expected)


def test_token_level_rewards_from_a_scored_batch(manager):
    result = manager.score(["Answer: 4", "Answer: 3"], ["4", "4"], ["s", "s"], [2, 16])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards = result.token_level_rewards(mask)
    assert rewards.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, -1.25]]
    assert torch.equal(rewards.sum(dim=1), result.scores)


def test_token_level_rewards_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="response_mask"):
        token_level_rewards(torch.zeros(3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="response_mask"):
        token_level_rewards(torch.zeros(2), torch.ones(2))


def test_unknown_scorer_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown reward scorer 'gsm8k'.*math_dapo.*math_verify"):
        RewardManager("gsm8k", max_response_length=MAX_LEN)


def test_registered_scorer_is_used(monkeypatch):
    monkeypatch.setattr(scorers, "SCORERS", dict(scorers.SCORERS))

    @scorers.register_scorer("length")
    class LengthScorer:
        def __init__(self, num_workers, timeout_s):
            pass

        def score_batch(self, solutions, ground_truths):
            return [{"score": float(len(s)), "acc": False, "pred": s} for s in solutions]

        def close(self):
            pass

    with pytest.raises(ValueError, match="already registered"):
        scorers.register_scorer("length")(LengthScorer)
    with RewardManager("length", max_response_length=MAX_LEN) as custom:
        result = custom.score(["abc", "a"], ["x", "y"], ["s", "s"], [1, 1])
    assert result.scores.tolist() == [3.0, 1.0]
    assert result.extras["timeout"].tolist() == [False, False]


def test_math_verify_scorer_through_the_manager():
    with RewardManager(
        "math_verify",
        max_response_length=MAX_LEN,
        overlong_enable=True,
        buffer_len=BUFFER,
        penalty_factor=FACTOR,
        num_workers=1,
    ) as symbolic:
        result = symbolic.score(["Answer: 0.5", "Answer: 0.5"], ["\\frac{1}{2}", "1/3"], ["s", "s"], [16, 4])
    assert result.scores.tolist() == [0.75, -1.0]
    assert result.extras["acc"].tolist() == [True, False]
    assert result.extras["timeout"].tolist() == [False, False]


def test_empty_batch(manager):
    result = manager.score([], [], [], [])
    assert result.scores.shape == (0,) and result.extras["pred"] == []


@pytest.mark.parametrize(
    ("lengths", "error", "match"),
    [
        ([3], ValueError, "batch size"),
        ([3.0, 4.0], TypeError, "integer"),
        ([[3, 4]], ValueError, "1-D"),
        ([3, -1], ValueError, ">= 0"),
    ],
)
def test_invalid_batches(manager, lengths, error, match):
    with pytest.raises(error, match=match):
        manager.score(["Answer: 1", "Answer: 2"], ["1", "2"], ["s", "s"], lengths)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_response_length": 0}, "max_response_length"),
        ({"max_response_length": 10, "overlong_enable": True, "buffer_len": 0}, "overlong_buffer.len"),
        ({"max_response_length": 10, "overlong_enable": True, "buffer_len": 11}, "overlong_buffer.len"),
    ],
)
def test_invalid_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardManager("math_dapo", **kwargs)


@pytest.mark.parametrize("metric", ["acc", "score", "seq_reward", "seq_final_reward", "overlong_reward"])
def test_every_filter_metric_works_on_a_scored_round(metric, tiny_tokenizer):
    """A round as the trainer makes it (engine generations -> batch -> score_batch), then dynamic
    sampling on each metric the schema names: groups whose members differ in it are kept."""
    from nemo_dapo.algo.sampling import GroupAccumulator
    from nemo_dapo.rollout.base import Generation
    from nemo_dapo.trainer.batching import build_rollout_batch
    from nemo_dapo.trainer.stages import score_batch

    def answer(text: str, pad_to: int = 0) -> list[int]:
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        return ids + tiny_tokenizer.encode(" x", add_special_tokens=False) * max(pad_to - len(ids), 0)

    right, wrong, long_wrong = answer("Answer: 4"), answer("Answer: 5"), answer("Answer: 5", pad_to=MAX_LEN)
    groups = [[right, wrong], [wrong, long_wrong], [right, right]]  # differ in acc; in length only; not at all
    generations = [
        Generation(token_ids=g, log_probs=[[0.0] * len(ids) for ids in g], finish_reasons=["stop"] * 2) for g in groups
    ]
    prompts = [tiny_tokenizer.encode("2+2")] * 3
    fields = {"ground_truth": ["4"] * 3, "data_source": ["math"] * 3, "prompt_index": [0, 1, 2]}
    batch = build_rollout_batch(prompts, generations, fields, "r", tiny_tokenizer.pad_token_id, 0)
    with RewardManager("math_dapo", max_response_length=MAX_LEN, overlong_enable=True, buffer_len=BUFFER) as reward:
        score_batch(batch, reward, tiny_tokenizer)
    accumulator = GroupAccumulator(target_groups=1, max_num_gen_batches=2, metric=metric)
    accumulator.add_round(batch)
    kept = accumulator.pop_batch()
    expected = {"acc": {0}, "score": {0, 1}, "seq_reward": {0, 1}, "seq_final_reward": {0, 1}, "overlong_reward": {1}}
    assert set(kept["prompt_index"]) <= expected[metric] and len(kept) == 2 * 1
