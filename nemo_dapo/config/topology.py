"""Quantities derived from a config, computed in one place: the job's shape and the run's length.

Validation, the capacity planner, the run assembly and the trainer all read these, so two
places can never disagree on how many GPUs a job has or how many steps a run takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_dapo.config.schema import Config
from nemo_dapo.config.schema_actor import MegatronConfig


@dataclass(frozen=True)
class Parallelism:
    """How the training ranks split a model: the one description of a layout, read by the
    planner (``nemo-dapo plan``, the start-up checks) and by the Megatron backend. The torch
    backend is the default: every rank a whole replica."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    virtual: int | None = None  # model chunks per pipeline rank (interleaved 1F1B); None = one
    context: int = 1  # ranks sharing each packed row's tokens (context parallelism)
    expert_tensor: int | None = None  # ranks splitting each expert (None: TP, megatron-core's default)

    @property
    def chunks_per_rank(self) -> int:
        return self.virtual or 1

    @property
    def etp(self) -> int:
        return self.expert_tensor or self.tensor

    def expert_groups(self, world: int) -> list[list[int]]:
        """The ranks of each expert-parallel group, in megatron-core's order for the expert grid
        (tp-cp-ep-dp-pp with ETP as its TP): EP ranks ETP apart, repeated over ETP offsets, expert
        DP and pipeline stages."""
        block = self.etp * self.expert
        return [
            [start + offset + self.etp * e for e in range(self.expert)]
            for start in range(0, world, block)
            for offset in range(self.etp)
        ]

    @classmethod
    def of(cls, layout: MegatronConfig) -> Parallelism:
        return cls(
            layout.tensor_model_parallel_size,
            layout.pipeline_model_parallel_size,
            layout.expert_model_parallel_size,
            layout.virtual_pipeline_model_parallel_size,
            layout.context_parallel_size,
            layout.expert_tensor_parallel_size,
        )

    @classmethod
    def of_config(cls, cfg: Config) -> Parallelism:
        """The actor's split: ``actor.megatron``'s with that backend, none with the torch one."""
        return cls.of(cfg.actor.megatron) if cfg.actor.backend == "megatron" else cls()


def training_world_size(cfg: Config) -> int:
    """Training ranks the launcher starts: ``actor.num_workers`` (one GPU each on a GPU cluster)."""
    return cfg.actor.num_workers


def expert_groups_across_nodes(cfg: Config) -> list[list[int]]:
    """The expert-parallel groups of the megatron layout whose ranks sit on more than one node
    (training rank r on node r // trainer.n_gpus_per_node): their all-to-all leaves the node's
    NVLink. None on CPUs or without expert parallelism."""
    gpus, parallel = cfg.trainer.n_gpus_per_node, Parallelism.of_config(cfg)
    if gpus == 0 or parallel.expert == 1:
        return []
    return [g for g in parallel.expert_groups(training_world_size(cfg)) if len({r // gpus for r in g}) > 1]


def has_rollout_pool(cfg: Config) -> bool:
    """The engines have nodes of their own (``trainer.rollout_pool``), the training ranks the rest."""
    return cfg.trainer.rollout_pool.nnodes > 0


def training_pool_gpus(cfg: Config) -> int:
    """GPUs of the training ranks' nodes: trainer.nnodes x trainer.n_gpus_per_node (0 in CPU mode);
    without a rollout pool, the engines' as well."""
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def engine_pool_gpus(cfg: Config) -> int:
    """GPUs the engines may take: the rollout pool's, or without one the job's."""
    pool = cfg.trainer.rollout_pool
    return pool.nnodes * pool.n_gpus_per_node if has_rollout_pool(cfg) else training_pool_gpus(cfg)


def cluster_gpus(cfg: Config) -> int:
    """GPUs of the job, both pools (0 in CPU mode)."""
    return training_pool_gpus(cfg) + (engine_pool_gpus(cfg) if has_rollout_pool(cfg) else 0)


def needs_reference(cfg: Config) -> bool:
    """DAPO has no KL term and then builds no reference model."""
    return cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss


def policy_groups(cfg: Config) -> int:
    """Worker groups of ``actor.num_workers`` ranks: the actor, and the reference model if needed."""
    return 2 if needs_reference(cfg) else 1


def engine_gpus(cfg: Config) -> int:
    """GPUs the vLLM engines take: rollout.num_workers x rollout.tensor_parallel_size."""
    return num_engines(cfg) * cfg.rollout.tensor_parallel_size


def num_engines(cfg: Config) -> int:
    """``rollout.num_workers``, which loading resolves (null: derived from the job's GPUs)."""
    engines = cfg.rollout.num_workers
    if engines is None:
        raise ValueError("rollout.num_workers is resolved when the config loads (load_config)")
    return engines


def is_colocated(cfg: Config) -> bool:
    """Training ranks and engines share the GPUs. CPU workers reserve no device, so there it means nothing."""
    return cfg.trainer.colocate and cfg.trainer.n_gpus_per_node > 0


def exporting_ranks(cfg: Config) -> int:
    """Training ranks that send the weights to the engines: one per pipeline stage."""
    return Parallelism.of_config(cfg).pipeline


def weight_transfer_path(cfg: Config) -> str:
    """``rollout.weight_transfer`` made concrete: as given, or for ``auto`` vLLM's nccl backend
    where the engines have GPUs of their own and one rank exports, gloo anywhere else (CPUs; a
    colocated engine shares its GPU with a training rank, which one NCCL group cannot hold twice;
    nccl's engines join one sender, pipeline stages export one each)."""
    path = cfg.rollout.weight_transfer
    if path != "auto":
        return path
    on_gpus = cfg.trainer.n_gpus_per_node > 0
    return "nccl" if on_gpus and not is_colocated(cfg) and exporting_ranks(cfg) == 1 else "gloo"


def prompts_per_round(cfg: Config) -> int:
    """Prompts one generation round draws: gen_batch_size under dynamic sampling, else train_batch_size."""
    return cfg.data.effective_gen_batch_size if cfg.algorithm.filter_groups.enable else cfg.data.train_batch_size


def total_training_steps(cfg: Config, dataset_size: int) -> int:
    """trainer.total_training_steps, or total_epochs x steps per epoch (at least one step)."""
    per_step = prompts_per_round(cfg)
    return cfg.trainer.total_training_steps or cfg.trainer.total_epochs * max(dataset_size // per_step, 1)


def total_optimizer_steps(cfg: Config, dataset_size: int) -> int:
    """Optimizer steps of the whole run (what a learning-rate schedule spans)."""
    mini_batches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    per_step = cfg.actor.ppo_epochs * mini_batches
    return total_training_steps(cfg, dataset_size) * per_step
