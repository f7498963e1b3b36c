"""Rollout correction (docs/algorithm.md §7) and metrics (docs/algorithm.md §9) against hand-computed values."""

import math

import pytest
import torch

from nemo_dapo.algo.correction import (
    PRESETS,
    CorrectionSettings,
    apply_rollout_correction,
    is_weights,
    parse_rs_modes,
    preset,
    rejection_mask,
    rollout_log_ratio,
)
from nemo_dapo.algo.metric_names import combine_steps
from nemo_dapo.algo.metrics import data_metrics, staleness_metrics, throughput_metrics, timing_metrics

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
LOG_R = torch.tensor([[0.1, -0.2, 1.0], [0.5, 0.3, 9.0]])  # 9.0 sits under the mask


def test_log_ratio_masked_and_clamped():
    lr = rollout_log_ratio(torch.tensor([[30.0, 0.0]]), torch.tensor([[0.0, 5.0]]), torch.tensor([[1.0, 0.0]]))
    assert lr.tolist() == [[20.0, 0.0]]


def test_token_is_truncated():
    w, m = is_weights(LOG_R * MASK, MASK, "token", threshold=2.0)
    assert w[0].tolist() == pytest.approx([math.exp(0.1), math.exp(-0.2), 2.0])
    assert w[1, 2].item() == 0.0
    assert m["rollout_corr/is_truncated_fraction"] == pytest.approx(1 / 5)


def test_sequence_is_is_product_broadcast():
    w, _ = is_weights(LOG_R * MASK, MASK, "sequence", threshold=10.0)
    assert w[0].tolist() == pytest.approx([math.exp(0.9)] * 3)
    assert w[1, :2].tolist() == pytest.approx([math.exp(0.8)] * 2)


def test_batch_normalised_weights_have_mean_one():
    w, _ = is_weights(LOG_R * MASK, MASK, "token", threshold=2.0, batch_normalize=True)
    assert (w * MASK).sum().item() / MASK.sum().item() == pytest.approx(1.0)


def test_no_is_level_means_no_weights():
    assert is_weights(LOG_R, MASK, None) == (None, {})
    with pytest.raises(ValueError):
        is_weights(LOG_R, MASK, "geometric")


def test_rejection_token_k1_ratio_range():
    modes = parse_rs_modes("token_k1", "0.9_1.2")
    keep, m = rejection_mask(LOG_R * MASK, MASK, modes)
    # r = e^0.1=1.105 ok, e^-0.2=0.819 out, e^1 out; e^0.5 out, e^0.3=1.35 out
    assert keep.tolist() == [[1, 0, 0], [0, 0, 0]]
    assert m["rollout_corr/rejected_fraction"] == pytest.approx(4 / 5)


def test_rejection_seq_mean_k1_geometric_mean_and_seq_max_k2():
    log_r = torch.tensor([[0.0005, -0.0005, 0.0], [0.01, 0.01, 0.0]])
    keep, _ = rejection_mask(log_r, MASK, parse_rs_modes("seq_mean_k1", "0.999_1.001"))
    assert keep.tolist() == [[1, 1, 1], [0, 0, 0]]
    keep, _ = rejection_mask(LOG_R * MASK, MASK, parse_rs_modes("seq_max_k2", "0.2"))
    assert keep.tolist() == [[0, 0, 0], [1, 1, 0]]  # 0.5 * 1^2 = 0.5 > 0.2 in row 0


def test_rejection_modes_combine_and_seq_sum_k3():
    def k3(x):
        return math.exp(x) - 1 - x

    row0 = k3(0.1) + k3(-0.2) + k3(1.0)
    row1 = k3(0.5) + k3(0.3)
    bound = (row0 + row1) / 2  # between the two: rejects only row 0
    keep, m = rejection_mask(LOG_R * MASK, MASK, parse_rs_modes("seq_sum_k3,token_k1", f"{bound},0.5_1.5"))
    assert keep.tolist() == [[0, 0, 0], [0, 1, 0]]  # token_k1 also drops e^0.5 = 1.65 > 1.5
    assert m["rollout_corr/rs_seq_sum_k3_rejected_fraction"] == pytest.approx(3 / 5)


@pytest.mark.parametrize(
    "modes,thresholds",
    [("token_k1", None), ("token_k1", "2.0"), ("seq_k9", "1"), ("token_k2", "-1"), ("token_k1,token_k2", "0.5_2")],
)
def test_bad_rejection_configs(modes, thresholds):
    with pytest.raises(ValueError):
        parse_rs_modes(modes, thresholds)


def test_a_k1_range_that_yaml_read_as_a_number_is_explained():
    """rollout_rs_threshold=0.5_2 on the command line arrives as 0.52 (YAML digit grouping)."""
    from nemo_dapo.config import load_config
    from nemo_dapo.errors import ConfigError

    overrides = [
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold",
    ]
    with pytest.raises(ConfigError, match=r"'0.52' for token_k1: .*YAML read a number here: quote"):
        load_config("tiny_cpu", [overrides[0], f"{overrides[1]}=0.5_2"])
    assert load_config("tiny_cpu", [overrides[0], f"{overrides[1]}=0.5_2.0"])  # two points: a string


def test_presets_and_apply():
    assert set(PRESETS) == {
        "decoupled_token_is",
        "decoupled_seq_is",
        "decoupled_geo_rs",
        "bypass_ppo_clip",
        "bypass_pg_is",
    }
    assert preset("bypass_pg_is") == CorrectionSettings("sequence", 2.0, False, None, None, True, "reinforce")
    with pytest.raises(ValueError, match="preset"):
        preset("nope")
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    rollout = old - LOG_R * MASK
    weights, mask, m = apply_rollout_correction(old, rollout, MASK, preset("decoupled_token_is"))
    assert weights[0, 2].item() == 2.0 and torch.equal(mask, MASK)
    assert m["rollout_corr/logprob_abs_diff_max"] == pytest.approx(1.0)
    assert m["rollout_corr/kl_k1"] == pytest.approx(-(0.1 - 0.2 + 1.0 + 0.5 + 0.3) / 5)
    weights, mask, _ = apply_rollout_correction(old, rollout, MASK, preset("decoupled_geo_rs"))
    assert weights is None and mask.sum().item() == 0  # both sequences far outside 0.999..1.001


def test_data_metrics_exclude_aborted():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    m = data_metrics(
        scores=torch.tensor([1.0, -1.0, 5.0]),
        rewards=torch.tensor([0.5, -1.0, 5.0]),
        advantages=torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0], [9.0, 0.0, 0.0]]),
        response_mask=mask,
        prompt_lengths=torch.tensor([4, 8, 2]),
        max_response_length=3,
        max_prompt_length=8,
        aborted=torch.tensor([False, False, True]),
    )
    assert m["critic/score/mean"] == 0.0 and m["critic/score/max"] == 1.0
    assert m["critic/rewards/min"] == -1.0
    assert m["critic/advantages/mean"] == pytest.approx((2 - 6) / 5)
    assert m["response_length/mean"] == 2.5 and m["response_length/clip_ratio"] == 0.5
    assert m["prompt_length/clip_ratio"] == 0.5 and m["response/aborted_ratio"] == pytest.approx(1 / 3)


def test_timing_throughput_staleness():
    t = timing_metrics({"gen": 2.0, "update_actor": 1.0}, num_response_tokens=100, num_total_tokens=400)
    assert t["timing_per_token_ms/gen"] == 20.0 and t["timing_per_token_ms/update_actor"] == 2.5
    assert throughput_metrics(1000, 2.0, 4)["perf/throughput"] == 125.0
    s = staleness_metrics([3, 5, 5], current_version=6)
    assert s["staleness/lag/max"] == 3 and s["staleness/lag/min"] == 1
    assert s["staleness/lag/mean"] == pytest.approx(5 / 3)


def test_token_staleness_counts_drawn_tokens_and_samples_spanning_versions():
    from nemo_dapo.algo.metrics import token_staleness_metrics

    versions = torch.tensor([[4, 4, 5, 0], [5, 5, 5, 5], [3, 3, 0, 0]])  # padding holds 0
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    m = token_staleness_metrics(versions, mask, current_version=5)
    lags = [1, 1, 0, 0, 0, 0, 0, 2, 2]
    assert m["staleness/token_lag/mean"] == pytest.approx(sum(lags) / len(lags))
    assert m["staleness/token_lag/max"] == 2 and m["staleness/token_lag/min"] == 0
    assert m["stream/partial_share"] == pytest.approx(1 / 3)  # only the first sample spans two versions


def test_reduce_metrics_mean_max_min():
    r = combine_steps({"actor/pg_loss": [1, 3], "x/max": [1, 5], "x/min": [2, -1], "empty": []})
    assert r == {"actor/pg_loss": 2.0, "x/max": 5.0, "x/min": -1.0}


def test_parts_of_a_shared_value_sum_and_extremes_stay_extremes():
    from nemo_dapo.algo.metric_names import combine_parts

    assert combine_parts("actor/pg_loss", [0.25, 0.5]) == 0.75  # each micro-batch holds its share
    assert combine_parts("actor/pg_clipfrac", [0.2, 0.4]) == pytest.approx(0.3)
    assert combine_parts("rollout_corr/is_weight_max", [1.5, 2.0]) == 2.0
    steps = combine_steps({"actor/pg_loss": [1.0, 3.0], "critic/score/min": [0.0, -1.0], "staleness/lag/max": [1, 2]})
    assert steps == {"actor/pg_loss": 2.0, "critic/score/min": -1.0, "staleness/lag/max": 2.0}


def test_monitoring_md_lists_the_metric_catalog():
    from pathlib import Path

    from nemo_dapo.algo.metric_names import catalog_markdown

    page = (Path(__file__).resolve().parents[1] / "docs" / "monitoring.md").read_text()
    table = page.split("<!-- metrics:begin -->\n", 1)[1].split("<!-- metrics:end -->", 1)[0]
    assert table == catalog_markdown(), "docs/monitoring.md is stale: paste the output of `nemo-dapo metrics`"
