"""Overlong filtering: responses the engine truncated leave the loss and every denominator,
exactly, whatever the micro-batch size or the number of data-parallel ranks."""

import pytest
import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.config import load_config
from nemo_dapo.config.validate import combination_notes
from nemo_dapo.policy.base import LossSettings, WorkerSettings
from nemo_dapo.policy.inputs import mini_batches_per_rank
from nemo_dapo.trainer.stages import add_overlong_filter
from tests.batches import REASONS, rollout_batch

TRUNCATED = [i for i, r in enumerate(REASONS) if r == "length"]


def config(filtering: bool):
    return load_config("tiny_cpu", [f"algorithm.overlong_filtering={str(filtering).lower()}"])


def test_truncated_rows_get_an_empty_loss_mask():
    batch = rollout_batch()
    metrics = add_overlong_filter(batch, config(True))
    assert metrics == {"overlong/filtered_fraction": pytest.approx(2 / 6)}
    kept = [i for i in range(6) if i not in TRUNCATED]
    assert batch["loss_mask"][TRUNCATED].sum() == 0
    assert torch.equal(batch["loss_mask"][kept], batch["response_mask"][kept])
    assert torch.equal(batch["response_mask"], rollout_batch()["response_mask"])  # lengths and metrics keep them
    off = rollout_batch()
    assert add_overlong_filter(off, config(False)) == {} and torch.equal(off["loss_mask"], off["response_mask"])


@pytest.mark.parametrize("world_size", [1, 2])
def test_mini_batch_denominators_count_only_the_kept_rows(world_size):
    batch = rollout_batch()
    add_overlong_filter(batch, config(True))
    kept = [i for i in range(6) if i not in TRUNCATED]
    per_rank = mini_batches_per_rank(batch, prompts_per_mini_batch=3, world_size=world_size, ppo_epochs=1)
    for rank in per_rank:
        (mini,) = rank
        assert mini.global_token_count == float(batch["response_mask"][kept].sum())  # 6 + 2 + 4 + 3
        assert mini.global_seq_count == 4.0
    assert sum(float(rank[0].data["loss_mask"].sum()) for rank in per_rank) == 15.0


def update_gradient(model_dir, batch: RolloutBatch, max_token_len: int) -> dict:
    """The mini-batch gradient of one update (Adam would amplify float noise in near-zero entries)."""
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from tests.batches import optim_settings

    worker = TorchPolicyWorker(0, 1, "", WorkerSettings(str(model_dir), optim_settings(), max_token_len=max_token_len))
    (minis,) = mini_batches_per_rank(batch, prompts_per_mini_batch=3, world_size=1, ppo_epochs=1)
    data = minis[0].data
    data["old_log_probs"] = worker.compute_log_prob(data)["log_probs"] - 0.05 * data["loss_mask"]
    gradient: dict = {}

    def keep_gradient(*_) -> None:  # the worker frees its gradients once the update is done
        gradient.update({name: param.grad.clone() for name, param in worker.model.named_parameters()})

    worker.optimizer.register_step_pre_hook(keep_gradient)
    worker.update(minis, LossSettings())
    return gradient


def test_the_update_equals_one_without_the_truncated_rows_for_any_micro_batch_size(tiny_model_dir):
    filtered = rollout_batch()
    add_overlong_filter(filtered, config(True))
    kept = [i for i in range(6) if i not in TRUNCATED]
    without = rollout_batch(kept)
    reference = update_gradient(tiny_model_dir, without, max_token_len=1000)
    one_micro = update_gradient(tiny_model_dir, filtered, max_token_len=1000)
    many_micro = update_gradient(tiny_model_dir, filtered, max_token_len=10)  # one row per micro-batch
    unfiltered = update_gradient(tiny_model_dir, rollout_batch(), max_token_len=1000)
    for name, grad in reference.items():
        assert torch.allclose(one_micro[name], grad, rtol=1e-4, atol=1e-7), name
        assert torch.allclose(many_micro[name], grad, rtol=1e-4, atol=1e-7), name
    assert any(not torch.allclose(unfiltered[n], g, rtol=1e-2) for n, g in reference.items())


def test_start_up_explains_filtering_together_with_the_soft_punishment():
    both = load_config(
        "tiny_cpu",
        [
            "algorithm.overlong_filtering=true",
            "reward.overlong_buffer.enable=true",
            "data.max_response_length=64",
            "reward.overlong_buffer.len=16",
        ],
    )
    (note,) = combination_notes(both)
    assert "soft punishment acts on the finished responses longer than 48 tokens" in note
    alone = load_config("tiny_cpu", ["algorithm.overlong_filtering=true", "reward.overlong_buffer.enable=false"])
    assert combination_notes(alone) == []


def test_tokens_older_than_max_token_staleness_leave_the_loss_and_compose_with_overlong_filtering():
    """Streaming: a sample drawn across an update keeps its newer tokens; a truncated one stays out."""
    from nemo_dapo.trainer.stages import add_stale_token_mask

    batch = rollout_batch()
    versions = torch.full_like(batch["responses"], 5)
    versions[:, :2] = 3  # every sample's first two tokens drawn two versions back
    batch.add("token_versions", versions)
    untouched = rollout_batch()
    assert add_stale_token_mask(untouched, 5, None) == {}
    assert torch.equal(untouched["loss_mask"], untouched["response_mask"])
    metrics = add_stale_token_mask(batch, current_version=5, max_token_staleness=1)
    response = batch["response_mask"]
    expected = response.clone()
    expected[:, :2] = 0
    assert torch.equal(batch["loss_mask"], expected)
    assert metrics["stream/stale_token_fraction"] == pytest.approx(float(response[:, :2].sum() / response.sum()))
    add_overlong_filter(batch, config(True))
    assert batch["loss_mask"][TRUNCATED].sum() == 0
    kept = [i for i in range(6) if i not in TRUNCATED]
    assert torch.equal(batch["loss_mask"][kept], expected[kept])
    assert add_stale_token_mask(rollout_batch(), 5, 2) == {}  # a round-based batch has no versions
