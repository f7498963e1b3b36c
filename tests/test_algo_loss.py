"""Policy loss and aggregation against hand-computed values (docs/algorithm.md §1-2)."""

import math

import pytest
import torch

from nemo_dapo.algo.loss import aggregate_loss
from nemo_dapo.algo.policy_losses import PolicyLossSettings as PL
from nemo_dapo.algo.policy_losses import dapo_loss, reinforce_loss


def one_token(old, new, adv, **kw):
    """Loss of a single valid token, so the aggregated loss is the token loss itself."""

    def t(v):
        return torch.tensor([[float(v)]])

    return dapo_loss(t(old), t(new), t(adv), torch.ones(1, 1), PL(**kw))


def test_unclipped_ratio_gives_minus_a_r():
    loss, m = one_token(0.0, math.log(1.1), 2.0)
    assert loss.item() == pytest.approx(-2.0 * 1.1)
    assert m["pg_clipfrac"] == 0.0


def test_clip_higher_caps_positive_advantage_at_1_plus_eps_high():
    loss, m = one_token(0.0, math.log(1.5), 1.0, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    assert m["pg_clipfrac"] == 1.0


def test_lower_clip_for_negative_advantage():
    # r = 0.5 < 1 - 0.2: L1 = 0.5, L2 = 0.8 -> max = 0.8 (pessimistic)
    loss, m = one_token(0.0, math.log(0.5), -1.0)
    assert loss.item() == pytest.approx(0.8)
    assert m["pg_clipfrac"] == 1.0
    assert m["pg_clipfrac_lower"] == 0.0


def test_dual_clip_caps_negative_advantage_at_c():
    # r = 50: L1 = 50, L2 = -(-1)*1.28 = 1.28 -> C1 = 50 > L3 = 10 -> loss 10
    loss, m = one_token(0.0, math.log(50.0), -1.0, clip_ratio_c=10.0)
    assert loss.item() == pytest.approx(10.0)
    assert m["pg_clipfrac_lower"] == 1.0


def test_dual_clip_inactive_for_positive_advantage():
    # A > 0 with huge ratio: clipped at 1 + eps_high, never at c
    loss, m = one_token(0.0, math.log(50.0), 1.0, clip_ratio_c=10.0)
    assert loss.item() == pytest.approx(-1.28)
    assert m["pg_clipfrac_lower"] == 0.0


def test_ratio_beyond_clamp_stays_finite():
    loss, m = one_token(0.0, 100.0, -1.0)  # log ratio clamped at 20: r = e^20
    assert loss.item() == pytest.approx(10.0)  # dual clip
    assert m["ppo_kl"] == pytest.approx(-20.0)
    loss, _ = one_token(100.0, 0.0, 1.0)  # r = e^-20, A > 0: -A r, clip lower gives -0.8
    assert loss.item() == pytest.approx(-math.exp(-20.0))


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        one_token(0.0, 0.0, 1.0, clip_ratio_c=1.0)


def test_gradient_zero_where_clipped():
    new = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    loss, _ = dapo_loss(torch.zeros(1, 2), new, torch.ones(1, 2), torch.ones(1, 2), PL())
    loss.backward()
    assert new.grad[0, 0].item() == 0.0
    assert new.grad[0, 1].item() == pytest.approx(-1.1 / 2)  # d(-r)/dlp = -r, token-mean over 2


def test_rollout_is_weights_scale_the_token_loss():
    def t(*v):
        return torch.tensor([list(map(float, v))])

    loss, _ = dapo_loss(t(0, 0), t(0, 0), t(1, 1), torch.ones(1, 2), PL(is_weights=t(0.5, 2.0)))
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)


def test_reinforce_loss():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    weights = PL(is_weights=torch.tensor([[1.0, 0.5]]))
    loss, _ = reinforce_loss(torch.zeros(1, 2), lp, torch.tensor([[2.0, 2.0]]), torch.ones(1, 2), weights)
    assert loss.item() == pytest.approx(-(2 * -1.0 * 1.0 + 2 * -2.0 * 0.5) / 2)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.0, -0.5])


LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 5 + 6) / 5),
        ("seq-mean-token-sum", ((1 + 2 + 3) + (5 + 6)) / 2),
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + (5 + 6) / 2) / 2),
        ("seq-mean-token-sum-norm", (1 + 2 + 3 + 5 + 6) / 4),
    ],
)
def test_aggregation_modes_ignore_fully_masked_rows(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_all_masked_gives_zero_not_nan():
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        value = aggregate_loss(torch.full((2, 3), float("nan")), torch.zeros(2, 3), mode)
        assert value.item() == 0.0


def test_norm_constant_overrides_padded_length():
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=17).item() == pytest.approx(17 / 17)


def test_unknown_mode_rejected():
    with pytest.raises(ValueError):
        aggregate_loss(LOSS, MASK, "token-sum")


def _random_batch(seed=0, rows=8, width=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 0, 5, 3, 7, 2, 4])[:rows]
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    return (
        torch.randn(rows, width, generator=g),
        torch.randn(rows, width, generator=g) * 0.3,
        torch.randn(rows, width, generator=g),
        mask,
    )


def _grad(old, new, adv, mask, mode, **agg):
    new = new.clone().requires_grad_(True)
    loss, _ = dapo_loss(old, new, adv, mask, PL(loss_agg_mode=mode, **agg))
    loss.backward()
    return new.grad


def _split_grad(old, new, adv, mask, mode, chunks):
    """Gradient rows from micro-batches normalised by the global counts."""
    counts = {
        "global_token_count": mask.sum(),
        "global_seq_count": (mask.sum(-1) > 0).sum(),
        "norm_constant": mask.shape[-1],
    }
    parts = [
        _grad(o, n, a, m, mode, **counts)
        for o, n, a, m in zip(old.chunk(chunks), new.chunk(chunks), adv.chunk(chunks), mask.chunk(chunks))
    ]
    return torch.cat(parts)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_gives_the_full_batch_gradient(mode):
    batch = _random_batch()
    full = _grad(*batch, mode)
    assert torch.allclose(_split_grad(*batch, mode, chunks=4), full, atol=1e-7)
    # the reference recipe's per-micro-batch mean is not exact: this is what the global counts fix
    naive = torch.cat([_grad(*[t.chunk(4)[i] for t in batch], mode) / 4 for i in range(4)])
    if mode != "seq-mean-token-sum-norm":
        assert not torch.allclose(naive, full, atol=1e-4)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_data_parallel_sum_gives_the_full_batch_gradient(mode):
    """Two simulated DP ranks, each 2 micro-batches; the workers sum the per-rank gradients."""
    old, new, adv, mask = _random_batch(seed=3)
    full = _grad(old, new, adv, mask, mode)
    counts = {"global_token_count": mask.sum(), "global_seq_count": (mask.sum(-1) > 0).sum()}
    weight = torch.zeros(old.shape[1], requires_grad=True)  # a shared parameter, as in a model
    rank_grads = []
    for rank_rows in (slice(0, 4), slice(4, 8)):
        total = torch.zeros_like(weight)
        for rows in (slice(rank_rows.start, rank_rows.start + 2), slice(rank_rows.start + 2, rank_rows.stop)):
            loss, _ = dapo_loss(old[rows], new[rows] + weight, adv[rows], mask[rows], PL(loss_agg_mode=mode, **counts))
            total += torch.autograd.grad(loss, weight)[0]
        rank_grads.append(total)
    assert torch.allclose(rank_grads[0] + rank_grads[1], full.sum(dim=0), atol=1e-6)
