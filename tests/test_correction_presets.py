"""Every rollout-correction preset runs a real training step (Ray + vLLM + torch worker) and logs its metrics."""

import pytest
import torch

from nemo_dapo.config import load_config
from nemo_dapo.policy.base import WorkerSettings
from nemo_dapo.trainer.assembly import resolve_paths

pytestmark = pytest.mark.slow

PRESET_METRICS = {
    "decoupled_token_is": ["rollout_corr/is_weight_mean", "rollout_corr/is_truncated_fraction"],
    "decoupled_seq_is": ["rollout_corr/is_weight_max", "rollout_corr/is_truncated_fraction"],
    "decoupled_geo_rs": ["rollout_corr/rs_seq_mean_k1_rejected_fraction", "rollout_corr/rejected_fraction"],
    "bypass_ppo_clip": ["rollout_corr/logprob_abs_diff_max", "actor/pg_clipfrac"],
    "bypass_pg_is": ["rollout_corr/is_weight_mean", "rollout_corr/kl_k3"],
}


@pytest.fixture(scope="module")
def components(local_ray, tiny_model_dir, tiny_tokenizer):
    from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
    from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup
    from nemo_dapo.data import RLDataset
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from nemo_dapo.reward.manager import RewardManager
    from nemo_dapo.rollout.base import EngineSettings
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    cfg = resolve_paths(load_config("tiny_cpu"))
    policy = PolicyGroup(
        WorkerGroup(
            TorchPolicyWorker, GroupSpec("actor", 1), {"settings": WorkerSettings(cfg.model.path, cfg.actor.optim)}
        )
    )
    rollout = RolloutGroup(
        WorkerGroup(VLLMRolloutWorker, GroupSpec("rollout", 1), {"settings": EngineSettings(cfg.model.path, 128)})
    )
    data = RLDataset(cfg.data.train_files, tiny_tokenizer, max_prompt_length=64)
    with RewardManager("math_dapo", max_response_length=16, overlong_enable=True, buffer_len=8) as reward:
        yield policy, rollout, data, reward
    policy.workers.shutdown()
    rollout.workers.shutdown()


@pytest.mark.parametrize("name", sorted(PRESET_METRICS))
def test_preset_runs_one_step(name, components, tiny_tokenizer, tmp_path):
    from nemo_dapo.trainer.fit import DAPOTrainer

    policy, rollout, data, reward = components
    cfg = resolve_paths(
        load_config(
            "tiny_cpu",
            [
                f"algorithm.rollout_correction.preset={name}",
                f"trainer.output_dir={tmp_path}",
                "data.train_batch_size=8",
                "data.gen_batch_size=12",
                "actor.ppo_mini_batch_size=4",
            ],
        )
    )
    trainer = DAPOTrainer(cfg, policy, rollout, tiny_tokenizer, data, None, reward)
    metrics = trainer.train_step()
    for key in PRESET_METRICS[name]:
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    if name.startswith("bypass"):
        assert "timing_s/old_log_prob" not in metrics  # bypass: old_log_prob := rollout_log_prob, no recompute
    else:
        assert "timing_s/old_log_prob" in metrics


@pytest.mark.parametrize("prompts_per_mini_batch", [4, 8])
def test_old_log_probs_from_the_update_train_the_step_the_old_log_prob_pass_does(
    components, tiny_tokenizer, tmp_path, monkeypatch, prompts_per_mini_batch
):
    """actor.old_log_prob_from_forward (the default) on a real step: one batch trained from one saved
    state with and without it gives the same old log-probs, metrics of the old policy, loss and
    gradient norm, while the old_log_prob pass scores only the rows of the later mini-batches
    (with one mini-batch, 8 prompts, it does not run)."""
    from nemo_dapo.algo.batch import group_rows
    from nemo_dapo.trainer.fit import DAPOTrainer
    from nemo_dapo.trainer.source import StepPlace
    from nemo_dapo.trainer.tracking import StageTimer

    policy, rollout, data, reward = components
    scored_rows = []
    score = policy.compute_log_prob
    monkeypatch.setattr(policy, "compute_log_prob", lambda batch, t: scored_rows.append(len(batch)) or score(batch, t))
    trainers = {
        flag: DAPOTrainer(
            resolve_paths(
                load_config(
                    "tiny_cpu",
                    [
                        f"trainer.output_dir={tmp_path / flag}",
                        "data.train_batch_size=8",
                        "data.gen_batch_size=12",
                        f"actor.ppo_mini_batch_size={prompts_per_mini_batch}",
                        f"actor.old_log_prob_from_forward={flag}",
                    ],
                )
            ),
            policy,
            rollout,
            tiny_tokenizer,
            data,
            None,
            reward,
        )
        for flag in ("true", "false")
    }
    batch, _ = trainers["true"].source.next_batch(StepPlace(0, 0, lambda: False), StageTimer())
    policy.save(str(tmp_path / "start"))
    runs = {}
    for flag, trainer in trainers.items():
        policy.load(str(tmp_path / "start"))
        trained = batch.select(range(len(batch)))
        runs[flag] = (trainer.update(trained, StageTimer()), trained)
    first_rows = sum(len(rows) for rows in list(group_rows(batch["uid"]).values())[:prompts_per_mini_batch])
    assert scored_rows == [len(batch) - first_rows] * (first_rows < len(batch)) + [len(batch)]
    (fused, fused_batch), (passed, passed_batch) = runs["true"], runs["false"]
    assert (fused_batch["old_log_probs"] - passed_batch["old_log_probs"]).abs().max().item() < 1e-5
    old_policy = [key for key in passed if key.startswith("rollout_corr/")] + ["actor/entropy_old"]
    assert len(old_policy) > 3 and all(key in fused for key in old_policy)
    for key in old_policy + ["actor/pg_loss"]:
        assert fused[key] == pytest.approx(passed[key], rel=1e-4, abs=1e-6), key
    assert fused["actor/grad_norm"] == pytest.approx(passed["actor/grad_norm"], rel=1e-4)
