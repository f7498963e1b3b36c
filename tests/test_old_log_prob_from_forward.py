"""The first mini-batch's old log-probs from its own training forward (actor.old_log_prob_from_forward):
the same update as with the old_log_prob pass, and the trainer's metrics of the old policy whole.

Megatron's side (gathered from the last pipeline stage): tests/test_megatron_worker.py.
"""

import pytest
import torch

from nemo_dapo.algo.correction import correction_settings
from nemo_dapo.config import load_config
from nemo_dapo.policy.base import LossSettings, WorkerSettings
from nemo_dapo.policy.inputs import mini_batch_rows, mini_batches_per_rank, worker_inputs
from nemo_dapo.trainer.old_policy import rows_scored_by_update
from tests.batches import rollout_batch

PROMPTS_PER_MINI_BATCH = 2  # 3 prompts x 2 samples: mini-batches of rows 0-3 and 4-5


def updated(tiny_model_dir, from_forward: bool) -> dict:
    """A fresh worker's log-probs, then one update of two mini-batches; with ``from_forward`` the
    first mini-batch's given old log-probs are zeros, which would change its loss if read."""
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from tests.batches import exported, optim_settings

    worker = TorchPolicyWorker(0, 1, "", WorkerSettings(str(tiny_model_dir), optim_settings(), max_token_len=40))
    batch = rollout_batch()
    scored = worker.compute_log_prob(worker_inputs(batch))
    old = scored["log_probs"].clone()
    first = mini_batch_rows(batch, PROMPTS_PER_MINI_BATCH)[0]
    if from_forward:
        old[first] = 0.0
    batch.add("old_log_probs", old)
    minis = mini_batches_per_rank(batch, PROMPTS_PER_MINI_BATCH, 1, 1, first_old_from_forward=from_forward)[0]
    assert [mini.old_from_forward for mini in minis] == [from_forward, False]
    result = worker.update(minis, LossSettings())
    return {"scored": scored, "first": first, "result": result, "weights": exported(worker)}


def test_the_first_mini_batch_trains_as_with_the_old_log_prob_pass(tiny_model_dir):
    passed, fused = updated(tiny_model_dir, False), updated(tiny_model_dir, True)
    assert passed["result"].first_forward is None
    first = fused["first"]
    assert first.tolist() == [0, 1, 2, 3]
    for key in ("log_probs", "entropy"):  # the forward's values are the pass's, rows in mini-batch order
        gap = fused["result"].first_forward[key] - passed["scored"][key][first]
        assert gap.abs().max().item() < 1e-5, key
    ours, theirs = fused["result"].metrics, passed["result"].metrics
    assert ours["actor/pg_loss"] == pytest.approx(theirs["actor/pg_loss"], abs=1e-6)
    assert ours["actor/grad_norm"] == pytest.approx(theirs["actor/grad_norm"], rel=1e-5)
    assert ours["actor/pg_clipfrac"] == theirs["actor/pg_clipfrac"]
    moved = max((fused["weights"][k] - passed["weights"][k]).abs().max().item() for k in passed["weights"])
    assert moved < 1e-4  # Adam's first step is ~lr * g / |g| (5e-3 here): rounding moves it a little


def test_only_the_first_step_of_the_first_epoch_takes_old_log_probs_from_its_forward():
    """Later epochs run on moved weights: their copy of the first mini-batch reads the pass's."""
    (steps,) = mini_batches_per_rank(rollout_batch(), PROMPTS_PER_MINI_BATCH, 1, 2, first_old_from_forward=True)
    assert len(steps) % 2 == 0 and [s.old_from_forward for s in steps] == [True] + [False] * (len(steps) - 1)
    assert torch.equal(steps[len(steps) // 2].data["loss_mask"], steps[0].data["loss_mask"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.old_log_prob_from_forward=false"],
        ["actor.ppo_epochs=2"],
        ["algorithm.use_kl_in_reward=true"],
        ["algorithm.rollout_correction.rollout_is=token"],
        [
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
        ],
        ["algorithm.rollout_correction.bypass_mode=true"],
    ],
    ids=lambda overrides: overrides[0].split("=")[0],
)
def test_only_exact_settings_take_old_log_probs_from_the_forward(overrides):
    batch = rollout_batch()
    base = load_config("tiny_cpu", [f"actor.ppo_mini_batch_size={PROMPTS_PER_MINI_BATCH}"])
    rows = rows_scored_by_update(batch, base, correction_settings(base.algorithm.rollout_correction))
    assert rows is not None and rows.tolist() == [0, 1, 2, 3]
    cfg = load_config("tiny_cpu", [f"actor.ppo_mini_batch_size={PROMPTS_PER_MINI_BATCH}", *overrides])
    assert rows_scored_by_update(batch, cfg, correction_settings(cfg.algorithm.rollout_correction)) is None


def test_routing_replay_keeps_the_old_log_prob_pass():
    cfg = load_config(
        "tiny_cpu",
        [
            "actor.backend=megatron",
            "actor.megatron.router_replay=r2",
            f"actor.ppo_mini_batch_size={PROMPTS_PER_MINI_BATCH}",
        ],
        placement=False,
    )
    assert rows_scored_by_update(rollout_batch(), cfg, correction_settings(cfg.algorithm.rollout_correction)) is None
