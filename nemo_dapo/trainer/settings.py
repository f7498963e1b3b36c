"""The one translation from the config to the typed settings each layer takes: the policy
workers (:class:`~nemo_dapo.policy.base.WorkerSettings`), their loss
(:class:`~nemo_dapo.policy.base.LossSettings`), the engines
(:class:`~nemo_dapo.rollout.base.EngineSettings`) and their sampling for training and
validation (:class:`~nemo_dapo.rollout.base.SamplingSettings`). The config's ``null``s are
already resolved when it loads (``config/load.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_dapo.algo.correction import CorrectionSettings
from nemo_dapo.config import Config
from nemo_dapo.config.topology import num_engines
from nemo_dapo.policy.base import LossSettings, WorkerSettings
from nemo_dapo.rollout.base import EngineSettings, SamplingSettings

if TYPE_CHECKING:
    from nemo_dapo.cluster.placement import SharedGPUs


def workers_per_node(cfg: Config, num_workers: int, gpus_per_worker: int = 1) -> int:
    """Workers that compute at the same time on one node, among which a worker's share of the
    node's cores is divided: on GPU nodes, those of its group that one node holds; on CPU nodes,
    the group's share of a node (all of it on one node), and in stream mode the engines too (they
    generate while the policy trains: 2 + 2 threads on 2 cores made a tiny overlapped step 3-4x
    slower than a synchronous one)."""
    if cfg.trainer.n_gpus_per_node == 0:
        overlapping = cfg.actor.num_workers + num_engines(cfg) if cfg.trainer.mode != "sync" else 0
        return -(-max(num_workers, overlapping) // cfg.trainer.nnodes)
    return max(1, min(num_workers, cfg.trainer.n_gpus_per_node // gpus_per_worker))


def loss_settings(cfg: Config, correction: CorrectionSettings) -> LossSettings:
    """What every policy worker's loss reads, from the config and the effective rollout correction."""
    actor = cfg.actor
    return LossSettings(
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        loss_agg_mode=actor.loss_agg_mode,
        policy_loss=actor.policy_loss,
        norm_constant=actor.loss_scale_factor,
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        loss_type=correction.loss_type,
        bypass_mode=correction.bypass_mode,
        temperature=cfg.rollout.temperature,
    )


def policy_settings(cfg: Config, total_optimizer_steps: int, trainable: bool = True) -> WorkerSettings:
    """What a policy worker is built from, read from the config: the training ranks, the reference
    model (``trainable=False``) and the benches' in-process worker alike."""
    return WorkerSettings(
        model_path=cfg.model.path,
        optim=cfg.actor.optim,
        dtype=cfg.model.dtype,
        total_steps=total_optimizer_steps,
        max_token_len=cfg.actor.max_token_len_per_micro_batch,
        logits_chunk_tokens=cfg.actor.logits_chunk_tokens,
        seed=cfg.trainer.seed,
        trainable=trainable,
        num_threads=cfg.trainer.cpu_threads_per_worker,
        workers_per_node=workers_per_node(cfg, cfg.actor.num_workers),
    )


def engine_settings(cfg: Config, shared: SharedGPUs | None) -> EngineSettings:
    """What each vLLM engine is built from; ``shared``: the GPUs it shares with training ranks."""
    from nemo_dapo.cluster.placement import SharedGPUs

    tp = cfg.rollout.tensor_parallel_size
    return EngineSettings(
        model_path=cfg.model.path,
        max_model_len=cfg.data.max_sequence_length,
        dtype=cfg.model.dtype,
        seed=cfg.trainer.seed,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        tensor_parallel_size=tp,
        enforce_eager=cfg.rollout.enforce_eager,
        enable_sleep_mode=shared is not None,
        distributed_executor_backend=SharedGPUs.engine_executor(tp) if shared else None,
        num_threads=cfg.trainer.cpu_threads_per_worker,
        workers_per_node=workers_per_node(cfg, num_engines(cfg), gpus_per_worker=tp),
        return_routing=cfg.actor.backend == "megatron" and cfg.actor.megatron.router_replay == "r3",
        weight_transfer=cfg.rollout.weight_transfer,
    )


def train_sampling(cfg: Config) -> SamplingSettings:
    """How the engines sample the training rounds (``rollout.*``)."""
    r = cfg.rollout
    return SamplingSettings(
        n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=cfg.data.max_response_length
    )


def val_sampling(cfg: Config) -> SamplingSettings:
    """How the engines sample validation (``rollout.val.*``): greedy unless ``do_sample``."""
    val = cfg.rollout.val
    return SamplingSettings(
        n=val.n,
        temperature=val.temperature if val.do_sample else 0.0,
        top_p=val.top_p if val.do_sample else 1.0,
        max_tokens=cfg.data.max_response_length,
    )
