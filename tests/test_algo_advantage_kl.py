"""GRPO advantages and KL penalties against hand-computed values (docs/algorithm.md §3-4)."""

import math

import pytest
import torch

from nemo_dapo.algo.advantage import AdvantageEstimator, get_advantage_estimator, register_adv_est
from nemo_dapo.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
    kl_penalty,
)


def rewards_at_end(scores, width=3):
    """Scores placed on the last token, as the reward manager does."""
    out = torch.zeros(len(scores), width)
    out[:, -1] = torch.tensor(scores, dtype=torch.float32)
    return out


def test_grpo_hand_computed_group():
    est = get_advantage_estimator("grpo")
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    adv, ret = est(token_level_rewards=rewards_at_end([1.0, 0.0, 0.0]), response_mask=mask, group_ids=["a"] * 3)
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased
    assert adv[0, 0].item() == pytest.approx((1 - mean) / (std + 1e-6))
    assert adv[1, 1].item() == pytest.approx((0 - mean) / (std + 1e-6))
    assert adv[1, 2].item() == 0.0 and adv[2, 1].item() == 0.0  # masked tokens
    assert torch.equal(adv, ret)


def test_grpo_without_std_normalisation():
    est = get_advantage_estimator(AdvantageEstimator.GRPO)
    adv, _ = est(
        token_level_rewards=rewards_at_end([3.0, 1.0]),
        response_mask=torch.ones(2, 3),
        group_ids=[7, 7],
        norm_adv_by_std=False,
    )
    assert adv[:, 0].tolist() == pytest.approx([1.0, -1.0])


def test_singleton_group_keeps_raw_score_and_equal_group_is_zero():
    est = get_advantage_estimator("grpo")
    adv, _ = est(
        token_level_rewards=rewards_at_end([0.7, 1.0, 1.0]),
        response_mask=torch.ones(3, 3),
        group_ids=["solo", "g", "g"],
    )
    assert adv[0, 0].item() == pytest.approx(0.7 / (1 + 1e-6))
    assert adv[1:].abs().max().item() == 0.0


def test_vectorized_equals_loop_on_ragged_groups():
    g = torch.Generator().manual_seed(0)
    group_ids = ["a"] * 5 + ["b"] + ["c"] * 3 + ["d"] * 4 + ["e"] * 2
    scores = torch.randint(0, 2, (len(group_ids),), generator=g).float() + torch.rand(len(group_ids), generator=g)
    scores[9:13] = 1.0  # group d: all equal
    mask = (torch.rand(len(group_ids), 6, generator=g) > 0.3).float()
    tokens = torch.zeros(len(group_ids), 6)
    tokens[:, 0] = scores
    for norm in (True, False):
        loop = get_advantage_estimator("grpo")(
            token_level_rewards=tokens, response_mask=mask, group_ids=group_ids, norm_adv_by_std=norm
        )
        vec = get_advantage_estimator("grpo_vectorized")(
            token_level_rewards=tokens, response_mask=mask, group_ids=group_ids, norm_adv_by_std=norm
        )
        assert torch.allclose(loop[0], vec[0], atol=1e-5)


def test_registry_rejects_unknown_and_duplicate_names():
    with pytest.raises(ValueError, match="registered"):
        get_advantage_estimator("ppo_gae_missing")
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo")(lambda **kw: None)

    @register_adv_est("test_constant_one")
    def constant(token_level_rewards, response_mask, group_ids, norm_adv_by_std=True, epsilon=1e-6):
        return response_mask, response_mask

    assert get_advantage_estimator("test_constant_one") is constant


LP = torch.tensor([-1.0, -2.0, -0.5])
REF = torch.tensor([-1.5, -1.0, -0.5])


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("kl", [0.5, -1.0, 0.0]),
        ("k1", [0.5, -1.0, 0.0]),
        ("abs", [0.5, 1.0, 0.0]),
        ("mse", [0.125, 0.5, 0.0]),
        ("k2", [0.125, 0.5, 0.0]),
        ("k3", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]),
        ("low_var_kl", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]),
    ],
)
def test_kl_values(kind, expected):
    assert kl_penalty(LP, REF, kind).tolist() == pytest.approx(expected)


def test_k3_clamped():
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0


@pytest.mark.parametrize("kind", ["kl+", "k1+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_straight_through_value_of_base_gradient_of_k2(kind):
    lp = LP.clone().requires_grad_(True)
    value = kl_penalty(lp, REF, kind)
    assert value.tolist() == pytest.approx(kl_penalty(LP, REF, kind[:-1]).tolist())
    value.sum().backward()
    assert lp.grad.tolist() == pytest.approx((LP - REF).tolist())  # d(0.5 d^2)/dlp = d


def test_full_and_unknown():
    with pytest.raises(NotImplementedError):
        kl_penalty(LP, REF, "full")
    with pytest.raises(ValueError, match="unknown"):
        kl_penalty(LP, REF, "k4")
    with pytest.raises(ValueError):
        kl_penalty(LP, REF, "full+")


def test_adaptive_controller_formula():
    ctl = AdaptiveKLController(value=0.1, target_kl=0.05, horizon=100)
    ctl.update(current_kl=0.06, n_steps=10)  # error = 0.2 (exactly at clip)
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctl.update(current_kl=0.5, n_steps=10)  # error 9 -> clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * 1.02 * 1.02)
    ctl.update(current_kl=0.0, n_steps=50)  # error -1 -> -0.2
    assert ctl.value == pytest.approx(0.1 * 1.02 * 1.02 * 0.9)


def test_fixed_controller_and_kl_in_reward():
    ctl = build_kl_controller("fixed", 0.5)
    assert isinstance(ctl, FixedKLController)
    scores = torch.tensor([[0.0, 0.0, 1.0]])
    rewards, metrics = apply_kl_in_reward(scores, LP[None], REF[None], torch.ones(1, 3), ctl, "kl")
    assert rewards.tolist()[0] == pytest.approx([-0.25, 0.5, 1.0])
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(-0.5 / 3)
    with pytest.raises(ValueError):
        build_kl_controller("pid", 0.1)
