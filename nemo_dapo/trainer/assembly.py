"""Build the workers, the data and the reward from a config (what ``nemo-dapo train`` runs the
trainer on, ``trainer/run.py``)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from nemo_dapo.cluster.allocator import allocator_env, keeps_freed_memory
from nemo_dapo.config import Config
from nemo_dapo.config.problems import raise_problems
from nemo_dapo.config.topology import has_rollout_pool, is_colocated, needs_reference, num_engines, policy_groups
from nemo_dapo.config.validate import separate_groups_problems
from nemo_dapo.model.builtin import resolve_builtin
from nemo_dapo.trainer.settings import engine_settings, policy_settings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup
    from nemo_dapo.cluster.placement import SharedGPUs
    from nemo_dapo.cluster.worker_group import WorkerGroup
    from nemo_dapo.data.dataset import RLDataset
    from nemo_dapo.reward.manager import RewardManager

log = logging.getLogger(__name__)


def resolve_paths(cfg: Config) -> Config:
    """Replace the built-in model / data names (``tiny``, ``smollm2-135m-instruct``, ...) by real paths
    (building them once)."""
    model_path, train_files, val_files = resolve_builtin(cfg.model.path, cfg.data.train_files, cfg.data.val_files)
    return replace(
        cfg,
        model=replace(cfg.model, path=model_path),
        data=replace(cfg.data, train_files=train_files, val_files=val_files),
    )


def _policy_workers(
    cfg: Config, name: str, total_optimizer_steps: int, shared: SharedGPUs | None, trainable: bool = True
) -> WorkerGroup:
    from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup

    worker_cls: type
    kwargs: dict = {"settings": policy_settings(cfg, total_optimizer_steps, trainable)}
    if cfg.actor.backend == "megatron":
        from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker

        worker_cls = MegatronPolicyWorker
        kwargs["layout"] = cfg.actor.megatron
    else:
        from nemo_dapo.policy.torch_worker import TorchPolicyWorker

        worker_cls = TorchPolicyWorker
        kwargs["attn_implementation"] = cfg.actor.attn_implementation
        kwargs["shared_prompt_forward"] = cfg.actor.shared_prompt_forward
    gpus = 1 if cfg.trainer.n_gpus_per_node > 0 else 0
    slots = shared.training_slots(cfg.actor.num_workers) if shared else None
    spec = GroupSpec(
        name,
        cfg.actor.num_workers,
        num_gpus_per_worker=gpus,
        slots=slots,
        strategy=cfg.trainer.placement_strategy,
        env=policy_start_env(cfg, gpus),
        call_timeout_s=cfg.trainer.remote_timeout_s,
        pool="train" if has_rollout_pool(cfg) else None,
    )
    return WorkerGroup(worker_cls, spec, kwargs, wait=shared is not None)


# One hardware queue per GPU: the order of kernels megatron-core's communication overlap relies on
# (its own check refuses TP/SP overlap without it). A Megatron rank's setting only: the engines
# sharing the GPU keep CUDA's default and their own concurrency.
MEGATRON_GPU_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def _start_env(cfg: Config, gpus: int) -> dict[str, str]:
    """What a worker's process needs in its start environment: the allocator settings
    (``trainer.keep_freed_memory``)."""
    return allocator_env(keeps_freed_memory(cfg.trainer.keep_freed_memory, on_gpu=gpus > 0), os.environ)


def policy_start_env(cfg: Config, gpus: int) -> dict[str, str]:
    """A training rank's start environment: a Megatron rank on a GPU adds ``MEGATRON_GPU_ENV``."""
    megatron = gpus > 0 and cfg.actor.backend == "megatron"
    return _start_env(cfg, gpus) | (MEGATRON_GPU_ENV if megatron else {})


def _rollout_workers(cfg: Config, shared: SharedGPUs | None) -> WorkerGroup:
    from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup
    from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker

    tp = cfg.rollout.tensor_parallel_size
    settings = engine_settings(cfg, shared)
    gpus = tp if cfg.trainer.n_gpus_per_node > 0 else 0
    slots = shared.engine_slots(num_engines(cfg), tp) if shared else None
    spec = GroupSpec(
        "rollout",
        num_engines(cfg),
        num_gpus_per_worker=gpus,
        slots=slots,
        strategy=cfg.trainer.placement_strategy,
        env=_start_env(cfg, gpus),
        call_timeout_s=cfg.rollout.timeout_s,
        timeout_key="rollout.timeout_s",
        start_timeout_s=cfg.trainer.remote_timeout_s,  # loading a model may take longer than a round
        pool="rollout" if has_rollout_pool(cfg) else None,
    )
    return WorkerGroup(VLLMRolloutWorker, spec, {"settings": settings}, wait=shared is not None)


@dataclass
class Workers:
    """The worker groups of one run, and the colocated placement they share (None: separate)."""

    policy: PolicyGroup
    ref: PolicyGroup | None
    rollout: RolloutGroup
    shared: SharedGPUs | None = None

    def shutdown(self) -> None:
        for group in (self.policy, self.ref, self.rollout):
            if group is not None:
                group.workers.shutdown()
        if self.shared is not None:
            self.shared.shutdown()


@dataclass
class StartingWorkers:
    """Worker groups asked for whose models may still be loading (see :func:`launch_workers`)."""

    policy: WorkerGroup
    ref: WorkerGroup | None
    rollout: WorkerGroup
    shared: SharedGPUs | None
    max_restarts: int
    min_engines: int

    def ready(self) -> Workers:
        """Wait until every worker is built; a worker that failed to build raises here."""
        from nemo_dapo.cluster.groups import PolicyGroup, RolloutGroup

        for group in (self.policy, self.ref, self.rollout):
            if group is not None:
                group.wait_ready()
        return Workers(
            PolicyGroup(self.policy),
            PolicyGroup(self.ref) if self.ref is not None else None,
            RolloutGroup(self.rollout, max_restarts=self.max_restarts, min_engines=self.min_engines),
            self.shared,
        )


def launch_workers(cfg: Config, total_optimizer_steps: int) -> StartingWorkers:
    """Policy (+ reference) and rollout groups, placed as ``trainer.colocate`` says.

    A layout that does not split the model (heads, layers, experts) and separate groups that
    cannot fit the job side by side are refused here, before Ray places anything. Separate groups
    load their models at the same time, and return before they are done (start-up is the longest
    of them, not their sum). Colocated, one :class:`~nemo_dapo.cluster.placement.SharedGPUs` holds
    every GPU and each group takes its share of each, one group after the other (the policy first,
    so the engines size their KV cache with the training state already resident).
    """
    import psutil

    from nemo_dapo.cluster.placement import SharedGPUs
    from nemo_dapo.config.model_checks import cpu_memory_problems, gpu_problems, head_node_gpus, startup_shape_problems

    host_gib = psutil.virtual_memory().total / 2**30
    gpus = head_node_gpus() if cfg.trainer.n_gpus_per_node and cfg.trainer.gpu_model else []
    raise_problems(
        separate_groups_problems(cfg)
        + startup_shape_problems(cfg)
        + cpu_memory_problems(cfg, host_gib)
        + gpu_problems(cfg, gpus)
    )
    shared = None
    if is_colocated(cfg):
        shared = SharedGPUs(cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, groups=policy_groups(cfg) + 1)
    policy = _policy_workers(cfg, "actor", total_optimizer_steps, shared)
    ref = _policy_workers(cfg, "ref", 1, shared, trainable=False) if needs_reference(cfg) else None
    rollout = _rollout_workers(cfg, shared)
    min_engines = cfg.rollout.min_engines or num_engines(cfg)  # resolved when the config loads
    return StartingWorkers(policy, ref, rollout, shared, cfg.rollout.max_restarts, min_engines)


def start_workers(cfg: Config, total_optimizer_steps: int) -> Workers:
    """:func:`launch_workers`, once they are ready."""
    return launch_workers(cfg, total_optimizer_steps).ready()


@dataclass
class RunData:
    tokenizer: PreTrainedTokenizerBase
    train: RLDataset
    val: RLDataset | None


def usable_inputs(cfg: Config) -> PreTrainedTokenizerBase:
    """The tokenizer, once it and the data files are known usable: what ``nemo-dapo train`` can
    refuse before Ray starts (found after the workers loaded, it would cost their start-up). The
    files exist and read as their format, the tokenizer has a chat template; the rows are read
    while the workers load (:func:`load_data`)."""
    from nemo_dapo.data.records import check_readable
    from nemo_dapo.model.tokenizer import load_tokenizer

    check_readable([*cfg.data.train_files, *(cfg.data.val_files or [])])
    return load_tokenizer(cfg.model.path)


def load_data(cfg: Config, tokenizer: PreTrainedTokenizerBase | None = None) -> RunData:
    """The tokenizer (``tokenizer``, if loaded already) and the training / held-out prompts (rows
    checked, overlong prompts dropped).

    The held-out set holds each distinct problem once, sampled ``rollout.val.n`` times: mean@n and
    pass@k average over problems, however many copies of one the files hold. The training set
    drops its copies only with ``data.drop_duplicate_prompts``."""
    from nemo_dapo.data import RLDataset
    from nemo_dapo.data.duplicates import warn_if_copies_outnumber_samples
    from nemo_dapo.model.tokenizer import load_tokenizer

    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model.path)

    def dataset(files: list[str], drop_duplicates: bool) -> RLDataset:
        return RLDataset(
            files,
            tokenizer,
            max_prompt_length=cfg.data.max_prompt_length,
            truncation=cfg.data.truncation,
            filter_overlong_prompts=cfg.data.filter_overlong_prompts,
            drop_duplicates=drop_duplicates,
        )

    val = dataset(cfg.data.val_files, drop_duplicates=True) if cfg.data.val_files else None
    if val is not None:
        warn_if_copies_outnumber_samples(val.duplicates, cfg.rollout.val.n, "rollout.val.n")
    return RunData(tokenizer, dataset(cfg.data.train_files, cfg.data.drop_duplicate_prompts), val)


def reward_manager(cfg: Config) -> RewardManager:
    from nemo_dapo.reward.manager import RewardManager

    buffer = cfg.reward.overlong_buffer
    return RewardManager(
        cfg.reward.scorer,
        max_response_length=cfg.data.max_response_length,
        overlong_enable=buffer.enable,
        buffer_len=buffer.len,
        penalty_factor=buffer.penalty_factor,
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
    )
