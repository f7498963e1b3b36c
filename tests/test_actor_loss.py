"""The shared actor loss in both rollout-correction modes, on hand-built batches (docs/algorithm.md §1, §7)."""

import math

import pytest
import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.algo.correction import preset
from nemo_dapo.policy.actor_loss import actor_loss
from nemo_dapo.policy.base import LossSettings
from nemo_dapo.policy.microbatch import MicroBatch
from nemo_dapo.trainer.stages import add_rollout_correction

MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
ADV = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
LP = torch.tensor([[-1.0, -0.5], [-2.0, -9.0]])
ROLLOUT = torch.tensor([[-1.2, -0.5], [-1.0, -9.0]])


def micro_batch(tensors: dict) -> MicroBatch:
    return MicroBatch(tensors, rows=torch.arange(2))


def test_bypass_reinforce_with_sequence_is():
    settings = LossSettings(loss_type="reinforce", bypass_mode=True)
    log_probs = LP.clone().requires_grad_(True)
    micro = micro_batch({"loss_mask": MASK, "advantages": ADV, "rollout_log_probs": ROLLOUT})
    loss, metrics = actor_loss(
        log_probs,
        torch.zeros_like(LP),
        ROLLOUT,  # bypass: the rollout policy is the old one
        micro,
        settings,
        global_token_count=3.0,
        global_seq_count=2.0,
        correction=preset("bypass_pg_is"),
    )
    w0 = min(math.exp((-1.0 + 1.2) + (-0.5 + 0.5)), 2.0)  # sequence ratio of the current policy to the engine
    w1 = min(math.exp(-2.0 + 1.0), 2.0)
    expected = -(1.0 * -1.0 * w0 + 1.0 * -0.5 * w0 + -2.0 * -2.0 * w1) / 3
    assert loss.item() == pytest.approx(expected)
    assert metrics["rollout_corr/is_weight_max"] == pytest.approx(w0)
    loss.backward()
    assert log_probs.grad[0].tolist() == pytest.approx([-w0 / 3, -w0 / 3])  # weights are detached


def test_decoupled_token_is_weights_enter_the_clipped_loss():
    batch = RolloutBatch({"old_log_probs": LP, "rollout_log_probs": ROLLOUT, "loss_mask": MASK.long()})
    metrics = add_rollout_correction(batch, preset("decoupled_token_is"))
    weights = batch["is_weights"]
    assert weights[0].tolist() == pytest.approx([math.exp(0.2), 1.0])
    assert weights[1, 0].item() == pytest.approx(math.exp(-1.0)) and weights[1, 1].item() == 0.0
    assert metrics["rollout_corr/logprob_abs_diff_max"] == pytest.approx(1.0)
    micro = micro_batch({"loss_mask": MASK, "advantages": ADV, "old_log_probs": LP, "is_weights": weights})
    new = LP + torch.tensor([[0.1, 0.5], [0.0, 0.0]])  # ratios 1.105 (inside), 1.65 (clipped at 1.28), 1
    loss, metrics = actor_loss(new, torch.zeros_like(LP), LP, micro, LossSettings(), 3.0, 2.0)
    expected = -(1.0 * math.exp(0.1) * math.exp(0.2) + 1.0 * 1.28 * 1.0 + -2.0 * 1.0 * math.exp(-1.0)) / 3
    assert loss.item() == pytest.approx(expected)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3)


def test_entropy_bonus_and_kl_loss_are_added_with_the_same_aggregation():
    micro = micro_batch({"loss_mask": MASK, "advantages": torch.zeros_like(ADV), "ref_log_probs": LP - 0.5})
    settings = LossSettings(entropy_coeff=0.1, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k1")
    entropy = torch.tensor([[1.0, 2.0], [3.0, 7.0]])
    loss, metrics = actor_loss(LP, entropy, LP, micro, settings, 3.0, 2.0)
    assert metrics["actor/entropy"] == pytest.approx(2.0) and metrics["actor/kl_loss"] == pytest.approx(0.5)
    assert loss.item() == pytest.approx(-0.1 * 2.0 + 0.2 * 0.5)
