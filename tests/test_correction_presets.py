"""Every rollout-correction preset runs a real training step (Ray + vLLM + torch worker) and logs its metrics."""

import pytest
import torch

from nemo_dapo.config import load_config
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
def components(tiny_model_dir, tiny_tokenizer):
    from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
    from nemo_dapo.cluster.ray_env import init_ray, shutdown_ray
    from nemo_dapo.cluster.worker_group import WorkerGroup
    from nemo_dapo.data import RLDataset
    from nemo_dapo.policy.torch_worker import TorchPolicyWorker
    from nemo_dapo.reward.manager import RewardManager
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    cfg = resolve_paths(load_config("tiny_cpu"))
    init_ray(num_cpus=2)
    policy = PolicyGroup(
        WorkerGroup(
            TorchPolicyWorker,
            1,
            name="actor",
            worker_kwargs={"model_path": cfg.model.path, "optim": cfg.actor.optim},
        )
    )
    rollout = RolloutGroup(
        WorkerGroup(
            VLLMRolloutWorker, 1, name="rollout", worker_kwargs={"model_path": cfg.model.path, "max_model_len": 128}
        )
    )
    data = RLDataset(cfg.data.train_files, tiny_tokenizer, max_prompt_length=64)
    with RewardManager("math_dapo", max_response_length=16, overlong_enable=True, buffer_len=8) as reward:
        yield policy, rollout, data, reward
    shutdown_ray()


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
