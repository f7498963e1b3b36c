"""The policy-loss registry: each loss against hand-computed values and gradients, split
exactness across micro-batches and data-parallel ranks, start-up checks, a user's own loss."""

import math

import pytest
import torch

from nemo_dapo.algo.loss import aggregate_loss
from nemo_dapo.algo.policy_losses import PolicyLossSettings, get_policy_loss
from nemo_dapo.config import ConfigError, load_config
from nemo_dapo.policy.base import WorkerSettings

BUILT_IN = ("dapo", "gspo", "gspo_token", "cispo", "gmpo")
SEQUENCE_LOSSES = ("gspo", "gspo_token", "gmpo")


def run(name, old, new, adv, mask, **kwargs):
    """(loss, d loss / d new, metrics) of the registered loss."""
    new = torch.tensor(new, dtype=torch.float32, requires_grad=True)
    tensor = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    mode = "seq-mean-token-mean" if name in SEQUENCE_LOSSES else "token-mean"
    settings = PolicyLossSettings(loss_agg_mode=kwargs.pop("loss_agg_mode", mode), **kwargs)
    loss, metrics = get_policy_loss(name).fn(tensor(old), new, tensor(adv), tensor(mask), settings)
    loss.backward()
    return loss.item(), new.grad, metrics


# row 0: log-ratios 0.1, 0.2, 0.3 (mean 0.2), A = +1; row 1: -0.5, -0.7 (mean -0.6), A = -1;
# row 2: fully masked (no denominator, no NaN)
OLD = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
NEW = [[0.1, 0.2, 0.3], [-0.5, -0.7, 9.0], [50.0, -50.0, 3.0]]
MASK = [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
ADV = [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [5.0, 5.0, 5.0]]


def test_gspo_clips_the_sequence_ratio():
    loss, grad, metrics = run("gspo", OLD, NEW, ADV, MASK)
    s0, s1 = math.exp(0.2), math.exp(-0.6)  # 1.2214 inside [0.8, 1.28]; 0.5488 below 0.8 with A < 0: clipped
    assert s1 < 0.8
    assert loss == pytest.approx((-s0 + 0.8) / 2, abs=1e-6)
    # row 0: d(-s0)/d lp_t = -s0 / 3 tokens / 2 sequences; row 1 clipped: no gradient
    assert torch.allclose(grad[0], torch.full((3,), -s0 / 6), atol=1e-6)
    assert torch.all(grad[1:] == 0)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)  # row 1's two tokens of the five


def test_gspo_token_has_gspos_value_and_per_token_advantage_gradients():
    adv = [[1.0, 2.0, 3.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]]
    seq_loss, seq_grad, _ = run("gspo", OLD, NEW, adv, MASK)
    tok_loss, tok_grad, _ = run("gspo_token", OLD, NEW, adv, MASK)
    s0 = math.exp(0.2)
    assert tok_loss == pytest.approx(seq_loss, abs=1e-6)  # unclipped, the loss is linear in A
    assert torch.allclose(seq_grad[0], torch.full((3,), -2 * s0 / 6), atol=1e-6)  # the row's mean advantage
    assert torch.allclose(tok_grad[0], torch.tensor([-1.0, -2.0, -3.0]) * s0 / 6, atol=1e-6)
    same = run("gspo_token", OLD, NEW, ADV, MASK)
    assert same[0] == pytest.approx(run("gspo", OLD, NEW, ADV, MASK)[0])  # one advantage per row: equal


def test_cispo_keeps_a_gradient_on_clipped_tokens():
    old, new, mask, adv = [[-1.0, -2.0]], [[-0.5, -2.1]], [[1, 1]], [[1.0, -1.0]]
    loss, grad, metrics = run("cispo", old, new, adv, mask)
    w0, w1 = 1.28, math.exp(-0.1)  # r = e^0.5 = 1.65 clipped to 1 + 0.28; e^-0.1 = 0.905 inside
    assert loss == pytest.approx((-w0 * 1 * -0.5 + -w1 * -1 * -2.1) / 2, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-w0 / 2, w1 / 2]]), atol=1e-6)
    assert metrics["pg_clipfrac"] == 0.5
    ppo = run("dapo", old, new, adv, mask)[1]
    assert ppo[0, 0] == 0 and grad[0, 0] != 0  # PPO drops the clipped token, CISPO re-weights it


def test_gmpo_takes_the_geometric_mean_of_per_token_clipped_ratios():
    old, new = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[0.5, -0.1, 0.2], [-0.5, 0.1, 0.0]]
    mask, adv = [[1, 1, 1], [1, 1, 0]], [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]
    loss, grad, metrics = run("gmpo", old, new, adv, mask)
    low, high = math.log(0.8), math.log(1.28)
    g0 = math.exp((high - 0.1 + 0.2) / 3)  # A > 0: min(log r, clip) -> 0.5 becomes log 1.28
    g1 = math.exp((low + 0.1) / 2)  # A < 0: max(log r, clip) -> -0.5 becomes log 0.8
    assert loss == pytest.approx((-g0 + g1) / 2, abs=1e-6)
    expected = torch.tensor([[0.0, -g0 / 3 / 2, -g0 / 3 / 2], [0.0, g1 / 2 / 2, 0.0]])
    assert torch.allclose(grad, expected, atol=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("name", BUILT_IN)
def test_extreme_ratios_and_empty_rows_stay_finite(name):
    loss, grad, _ = run(name, OLD, NEW, ADV, MASK)
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.all(grad[2] == 0)  # the masked row's 50-nat log-ratios reach nothing


def _random(seed=0, rows=8, width=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 0, 5, 3, 6, 2, 4])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    adv = torch.randn(rows, 1, generator=g).expand(rows, width).contiguous()
    return -torch.rand(rows, width, generator=g), torch.randn(rows, width, generator=g) * 0.3 - 0.5, adv, mask


@pytest.mark.parametrize("name", BUILT_IN)
def test_micro_batches_and_data_parallel_ranks_give_the_full_batch_gradient(name):
    """4 micro-batches over 2 simulated DP ranks (DDP averages): the gradient of one batch."""
    old, new, adv, mask = _random()
    loss = get_policy_loss(name)
    mode = loss.loss_agg_modes[0] if name in SEQUENCE_LOSSES else "token-mean"

    def grad(rows, **counts):
        leaf = new[rows].clone().requires_grad_(True)
        value, _ = loss.fn(old[rows], leaf, adv[rows], mask[rows], PolicyLossSettings(loss_agg_mode=mode, **counts))
        value.backward()
        return leaf.grad

    full = grad(slice(0, 8))
    counts = {"global_token_count": mask.sum(), "global_seq_count": (mask.sum(-1) > 0).sum()}
    split = torch.cat([grad(slice(r, r + 2), **counts) for r in range(0, 8, 2)])
    assert full.abs().sum() > 0
    assert torch.allclose(split, full, atol=1e-6)


def test_sequence_losses_refuse_token_aggregation_at_start_up():
    with pytest.raises(
        ConfigError,
        match=r"actor.policy_loss=gspo is defined for actor.loss_agg_mode in "
        r"\['seq-mean-token-mean'\], not 'token-mean'",
    ):
        load_config("tiny_cpu", ["actor.policy_loss=gspo", "actor.loss_agg_mode=token-mean"])
    cfg = load_config("tiny_cpu", ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean"])
    assert cfg.actor.policy_loss == "gspo"


def test_an_unknown_loss_names_the_known_ones():
    with pytest.raises(
        ConfigError,
        match=r"actor.policy_loss='ppo2' is not a registered policy loss; known: "
        r"\['cispo', 'dapo', 'gmpo', 'gspo', 'gspo_token'",
    ):
        load_config("tiny_cpu", ["actor.policy_loss=ppo2"])
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        load_config("tiny_cpu", ["actor.policy_loss=no_such_module:loss"])


def test_bypass_reinforce_refuses_another_policy_loss():
    with pytest.raises(ConfigError, match="bypass mode's REINFORCE loss"):
        load_config(
            "tiny_cpu",
            [
                "actor.policy_loss=cispo",
                "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.rollout_correction.loss_type=reinforce",
            ],
        )


def test_a_user_registered_loss_is_used_by_name_in_a_real_worker(tiny_model_dir):
    from nemo_dapo.policy.base import LossSettings, MiniBatch
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from tests.batches import add_training_fields, make_batch, optim_settings

    name = "tests.custom_policy_loss:doubled_dapo"
    assert load_config("tiny_cpu", [f"actor.policy_loss={name}"]).actor.policy_loss == name
    batch = make_batch()
    pg_loss = {}
    for loss in ("dapo", name):  # a fresh worker each: the same weights see the same batch
        worker = TorchPolicyWorker(0, 1, "", WorkerSettings(str(tiny_model_dir), optim_settings(), max_token_len=40))
        full = add_training_fields(batch, worker.compute_log_prob(batch)["log_probs"] - 0.1)
        mini = [MiniBatch(full, float(batch["loss_mask"].sum()), float(len(batch["input_ids"])))]
        pg_loss[loss] = sum(worker.update(mini, LossSettings(policy_loss=loss)).metrics["actor/pg_loss"])
    assert pg_loss[name] == pytest.approx(2 * pg_loss["dapo"], rel=1e-5)
    assert abs(pg_loss["dapo"]) > 1e-4


def test_registered_losses_reduce_with_the_shared_aggregation():
    """Every built-in returns aggregate_loss of its matrix: with all-equal rows it is the row value."""
    old, new, adv, mask = torch.zeros(2, 3), torch.full((2, 3), 0.1), torch.ones(2, 3), torch.ones(2, 3)
    settings = PolicyLossSettings(loss_agg_mode="seq-mean-token-mean")
    for name in BUILT_IN:
        value, _ = get_policy_loss(name).fn(old, new, adv, mask, settings)
        per_token = -math.exp(0.1) * (0.1 if name == "cispo" else 1.0)  # CISPO: -w A lp, w = r
        assert value.item() == pytest.approx(
            aggregate_loss(torch.full((2, 3), per_token), mask, "seq-mean-token-mean").item(), abs=1e-6
        ), name
