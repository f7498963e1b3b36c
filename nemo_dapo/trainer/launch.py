"""Build the workers from a config and run the trainer: the body of ``nemo-dapo train``."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, replace
from pathlib import Path

from nemo_dapo.config import Config
from nemo_dapo.model.tiny import resolve_builtin

log = logging.getLogger(__name__)


def resolve_paths(cfg: Config) -> Config:
    """Replace the built-in ``tiny`` model / data names by real paths (building them once)."""
    model_path, train_files, val_files = resolve_builtin(cfg.model.path, cfg.data.train_files, cfg.data.val_files)
    return replace(cfg, model=replace(cfg.model, path=model_path),
                   data=replace(cfg.data, train_files=train_files, val_files=val_files))


def _policy_group(cfg: Config, name: str, total_optimizer_steps: int):
    from nemo_dapo.cluster.groups import PolicyGroup
    from nemo_dapo.cluster.worker_group import WorkerGroup

    kwargs = {"model_path": cfg.model.path, "optim": asdict(cfg.actor.optim), "dtype": cfg.model.dtype,
              "total_steps": total_optimizer_steps, "max_token_len": cfg.actor.max_token_len_per_micro_batch,
              "seed": cfg.trainer.seed}
    if cfg.actor.backend == "megatron":
        from nemo_dapo.policy.megatron_worker import MegatronPolicyWorker as worker_cls

        layout = cfg.actor.megatron
        kwargs.update(tensor_parallel_size=layout.tensor_model_parallel_size,
                      pipeline_parallel_size=layout.pipeline_model_parallel_size,
                      expert_parallel_size=layout.expert_model_parallel_size)
    else:
        from nemo_dapo.policy.torch_worker import TorchPolicyWorker as worker_cls
    gpus = 1 if cfg.trainer.n_gpus_per_node > 0 else 0
    return PolicyGroup(WorkerGroup(worker_cls, cfg.actor.num_workers, name=name, num_gpus_per_worker=gpus,
                                   worker_kwargs=kwargs))


def _rollout_group(cfg: Config):
    from nemo_dapo.cluster.groups import RolloutGroup
    from nemo_dapo.cluster.worker_group import WorkerGroup
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    kwargs = {"model_path": cfg.model.path, "max_model_len": cfg.data.max_prompt_length + cfg.data.max_response_length,
              "dtype": cfg.model.dtype, "seed": cfg.trainer.seed,
              "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
              "tensor_parallel_size": cfg.rollout.tensor_parallel_size}
    gpus = cfg.rollout.tensor_parallel_size if cfg.trainer.n_gpus_per_node > 0 else 0
    return RolloutGroup(WorkerGroup(VLLMRolloutWorker, cfg.rollout.num_workers, name="rollout",
                                    num_gpus_per_worker=gpus, worker_kwargs=kwargs))


def run_training(cfg: Config) -> dict:
    from transformers import AutoTokenizer

    from nemo_dapo.cluster.ray_env import init_ray, shutdown_ray
    from nemo_dapo.data import RLDataset
    from nemo_dapo.reward.manager import RewardManager
    from nemo_dapo.trainer.fit import DAPOTrainer

    cfg = resolve_paths(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    data_kwargs = {"max_prompt_length": cfg.data.max_prompt_length, "truncation": cfg.data.truncation,
                   "filter_overlong_prompts": cfg.data.filter_overlong_prompts}
    train_data = RLDataset(cfg.data.train_files, tokenizer, **data_kwargs)
    val_data = RLDataset(cfg.data.val_files, tokenizer, **data_kwargs) if cfg.data.val_files else None
    buffer = cfg.reward.overlong_buffer
    reward = RewardManager(cfg.reward.scorer, max_response_length=cfg.data.max_response_length,
                           overlong_enable=buffer.enable, buffer_len=buffer.len, penalty_factor=buffer.penalty_factor,
                           num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
    workers = cfg.actor.num_workers + cfg.rollout.num_workers + (cfg.actor.num_workers if needs_reference(cfg) else 0)
    init_ray(num_cpus=max(os.cpu_count() or 1, workers))
    try:
        steps_per_epoch = len(train_data) // (cfg.data.effective_gen_batch_size if cfg.algorithm.filter_groups.enable
                                              else cfg.data.train_batch_size)
        total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * max(steps_per_epoch, 1)
        optimizer_steps = total_steps * cfg.actor.ppo_epochs * (cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)
        policy = _policy_group(cfg, "actor", optimizer_steps)
        ref = _policy_group(cfg, "ref", 1) if needs_reference(cfg) else None
        rollout = _rollout_group(cfg)
        if cfg.trainer.mode == "async":
            from nemo_dapo.trainer.async_fit import AsyncDAPOTrainer
            from nemo_dapo.trainer.data_plane import DataPlane

            trainer = AsyncDAPOTrainer(cfg, policy, rollout, tokenizer, train_data, val_data, reward, ref_policy=ref,
                                       plane=DataPlane())
        else:
            trainer = DAPOTrainer(cfg, policy, rollout, tokenizer, train_data, val_data, reward, ref_policy=ref)
        summary = trainer.fit()
        export_dir = Path(cfg.trainer.output_dir) / "hf_export"
        export_hf(trainer.checkpoints.step_folders()[0][1], cfg.model.path, export_dir)
        summary["hf_export"] = str(export_dir)
        return summary
    finally:
        reward.close()
        shutdown_ray()


def needs_reference(cfg: Config) -> bool:
    """DAPO has no KL term and then builds no reference model."""
    return cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss


def export_hf(checkpoint: str | Path, tokenizer_source: str | Path, output_dir: str | Path) -> Path:
    """A servable Hugging Face folder: the checkpoint's weights + the tokenizer files."""
    import shutil

    from nemo_dapo.trainer.checkpoint import verify

    checkpoint, output_dir = verify(checkpoint), Path(output_dir)
    shutil.rmtree(output_dir, ignore_errors=True)
    shutil.copytree(checkpoint / "policy" / "model", output_dir)
    for source in Path(tokenizer_source).iterdir():
        if source.is_file() and (source.name.startswith("tokenizer") or source.name in ("chat_template.jinja",
                                                                                         "special_tokens_map.json")):
            shutil.copy2(source, output_dir / source.name)
    return output_dir
