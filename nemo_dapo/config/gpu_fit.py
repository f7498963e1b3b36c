"""Will a GPU layout fit its GPUs: the memory verdict ``nemo-dapo plan`` prints, ``nemo-dapo train``
enforces before anything starts (a layout that cannot fit would load the model and run out of
memory, which a batch job takes for a crash and requeues), and the smallest change that makes a
colocated layout fit, which the bring-up ladder applies to a preset run on fewer nodes
(docs/cluster.md, "Bring-up ladder"). The formulas are :mod:`~nemo_dapo.config.capacity`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nemo_dapo.config.architecture import Architecture, resolve_architecture
from nemo_dapo.config.capacity import (
    ColocatedMemory,
    GenerationMemory,
    TrainingMemory,
    colocated_memory,
    generation_memory,
    gpu_memory_gib,
    training_memory,
)
from nemo_dapo.config.schema import Config
from nemo_dapo.config.topology import has_rollout_pool, is_colocated

RESERVE_GIB = 4.0  # per GPU and phase: CUDA context, NCCL buffers, fragmentation
MIN_HEADROOM_GIB = 2.0  # what a fitted layout leaves beyond the reserve
SKIP = "(the memory model of `nemo-dapo plan`; trainer.gpu_model=null skips this check)"


@dataclass(frozen=True)
class GpuMemory:
    """GiB per GPU of a layout in both phases, on GPUs of ``gpu_gib``."""

    training: TrainingMemory
    generation: GenerationMemory
    colocated: ColocatedMemory | None  # None: training and engines on GPUs of their own
    gpu_gib: float

    @property
    def peak(self) -> float:
        """The busiest moment of a training GPU (engines on GPUs of their own keep
        ``1 - gpu_memory_utilization`` free by construction)."""
        return self.colocated.peak if self.colocated else self.training.total

    @property
    def headroom(self) -> float:
        return self.gpu_gib - self.peak


def released_grads(cfg: Config) -> bool:
    return cfg.actor.backend == "megatron" and cfg.actor.megatron.release_grad_buffers


def engine_gpu_gib(cfg: Config, gpu_gib: float) -> float:
    """The memory of an engine's GPU: the rollout pool's model (``trainer.rollout_pool.gpu_model``)
    where it names one, else the training GPUs' ``gpu_gib``."""
    pool_gpu = cfg.trainer.rollout_pool.gpu_model if has_rollout_pool(cfg) else None
    return gpu_memory_gib(pool_gpu) if pool_gpu else gpu_gib


def gpu_memory(cfg: Config, arch: Architecture, gpu_gib: float, reserve_gib: float = RESERVE_GIB) -> GpuMemory:
    """Both phases' memory per GPU; an engine's on the rollout pool's GPU where there is one."""
    training = training_memory(cfg, arch, reserve_gib)
    generation = generation_memory(cfg, arch, engine_gpu_gib(cfg, gpu_gib), reserve_gib)
    colocated = colocated_memory(training, generation, released_grads(cfg)) if is_colocated(cfg) else None
    return GpuMemory(training, generation, colocated, gpu_gib)


def with_utilization(cfg: Config, utilization: float) -> Config:
    return replace(cfg, rollout=replace(cfg.rollout, gpu_memory_utilization=utilization))


def with_released_grads(cfg: Config) -> Config:
    megatron = replace(cfg.actor.megatron, release_grad_buffers=True)
    return replace(cfg, actor=replace(cfg.actor, megatron=megatron))


def largest_utilization(
    cfg: Config, arch: Architecture, gpu_gib: float, reserve_gib: float = RESERVE_GIB, headroom_gib: float = 0.0
) -> float | None:
    """The largest ``rollout.gpu_memory_utilization`` (in hundredths) at which the colocated
    layout fits with ``headroom_gib`` to spare and the KV cache still holds one full-length
    sequence; None when none does."""
    for hundredths in range(95, 0, -1):
        fitted = with_utilization(cfg, hundredths / 100)
        memory = gpu_memory(fitted, arch, gpu_gib, reserve_gib)
        if not _phase_problems(memory) and memory.headroom >= headroom_gib:
            return hundredths / 100
    return None


def _phase_problems(memory: GpuMemory) -> list[str]:
    """What does not fit, without the fixes (:func:`memory_problems` names them)."""
    problems = []
    if memory.training.total > memory.gpu_gib:
        problems.append("training")
    if memory.generation.full_sequences < 1:
        problems.append("kv")
    if memory.colocated and memory.colocated.generation_phase > memory.gpu_gib:
        problems.append("colocated")
    return problems


def memory_problems(cfg: Config, arch: Architecture, gpu_gib: float, reserve_gib: float = RESERVE_GIB) -> list[str]:
    """Every way the layout runs out of GPU memory, each with the change that fixes it."""
    memory = gpu_memory(cfg, arch, gpu_gib, reserve_gib)
    training, generation, colocated = memory.training, memory.generation, memory.colocated
    found, problems = _phase_problems(memory), []
    if "training" in found:
        problems.append(
            f"training needs {training.total:.1f} GiB per GPU, the GPU has {gpu_gib:.4g} GiB: raise "
            "TP / PP / CP (CP splits long sequences), or turn on recompute_granularity=full or the "
            "distributed optimizer"
        )
    if "kv" in found:
        problems.append(
            f"vLLM: {generation.kv_cache:.1f} GiB left for the KV cache holds {generation.kv_tokens} "
            f"tokens, less than one {generation.sequence_tokens}-token sequence: raise "
            "rollout.tensor_parallel_size or rollout.gpu_memory_utilization"
        )
    if "colocated" in found and colocated is not None:
        problems.append(
            f"colocated generation needs {colocated.generation_phase:.1f} GiB per GPU, the GPU has "
            f"{gpu_gib:.4g} GiB: training keeps {colocated.training_kept:.1f} GiB (weights, gradients, "
            f"optimizer, reserve) beside vLLM's {colocated.vllm:.1f} GiB: "
            + colocated_fixes(cfg, arch, gpu_gib, reserve_gib)
        )
    return problems


def colocated_fixes(cfg: Config, arch: Architecture, gpu_gib: float, reserve_gib: float) -> str:
    """The settings that make a colocated layout fit, the cheapest first."""
    fixes = []
    utilization = largest_utilization(cfg, arch, gpu_gib, reserve_gib)
    if utilization is not None:
        fixes.append(f"lower rollout.gpu_memory_utilization to <= {utilization:.2f}")
    if cfg.actor.backend == "megatron" and not cfg.actor.megatron.release_grad_buffers:
        released = largest_utilization(with_released_grads(cfg), arch, gpu_gib, reserve_gib)
        if released is not None:
            fixes.append(
                f"set actor.megatron.release_grad_buffers=true (then rollout.gpu_memory_utilization <= {released:.2f})"
            )
    if not fixes:
        fixes.append("no rollout.gpu_memory_utilization leaves the KV cache one full-length sequence")
    return "; ".join(fixes) + "; or shard the training state further (more nodes), or set trainer.colocate=false"


def fitting_overrides(
    cfg: Config, arch: Architecture, gpu_gib: float, headroom_gib: float = MIN_HEADROOM_GIB
) -> list[str] | None:
    """Overrides that make the layout fit with ``headroom_gib`` to spare: none when it does; else
    the largest engine share that fits, with the gradient buffers released (colocated Megatron)
    only where no share fits without; None when nothing does (more nodes are needed)."""
    memory = gpu_memory(cfg, arch, gpu_gib)
    if not _phase_problems(memory) and memory.headroom >= headroom_gib:
        return []
    if memory.colocated is None or "training" in _phase_problems(memory):
        return None
    attempts = [(cfg, [])]
    if cfg.actor.backend == "megatron" and not cfg.actor.megatron.release_grad_buffers:
        attempts.append((with_released_grads(cfg), ["actor.megatron.release_grad_buffers=true"]))
    for attempt, overrides in attempts:
        utilization = largest_utilization(attempt, arch, gpu_gib, headroom_gib=headroom_gib)
        if utilization is not None:
            return [*overrides, f"rollout.gpu_memory_utilization={utilization:.2f}"]
    return None


def startup_memory_problems(cfg: Config) -> list[str]:
    """:func:`memory_problems` for a GPU run about to start, on ``trainer.gpu_model``'s memory,
    when the model's shape can be known (a local folder or a listed model)."""
    if cfg.trainer.n_gpus_per_node == 0 or cfg.trainer.gpu_model is None:
        return []
    try:
        arch = resolve_architecture(cfg.model.path)
    except (ValueError, KeyError):
        return []
    gpu = cfg.trainer.gpu_model
    return [f"{problem} {SKIP}" for problem in memory_problems(cfg, arch, gpu_memory_gib(gpu))]
