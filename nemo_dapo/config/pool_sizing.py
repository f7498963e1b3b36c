"""How many rollout nodes keep a training pool busy (``nemo-dapo plan`` with ``trainer.rollout_pool``).

An estimate from a roofline, not a measurement (docs/cluster.md, "Two pools"): a training step's
work is ``8 x params`` FLOPs per token (the update's forward and backward, 6, and the old-policy
forward, 2; 2 more with a reference model), done at ``TRAIN_MFU`` of the training GPUs' peak; a
decode step of one engine reads its weights and its running sequences' keys and values once at
``DECODE_BANDWIDTH`` of the GPU's memory bandwidth, or computes ``2 x params`` FLOPs per sequence at
``DECODE_FLOPS`` of its peak, whichever is slower. The GPU figures are datasheet peaks (dense BF16,
HBM); the efficiencies and the mean lengths are assumptions the plan names. From these: the time a
step spends generating and updating, the pools' idle shares in the sync mode (they take turns) and
the stream mode (they overlap), and the rollout nodes per training node at which both finish together.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_dapo.config.architecture import Architecture
from nemo_dapo.config.capacity import GenerationMemory
from nemo_dapo.config.schema import Config
from nemo_dapo.config.topology import needs_reference

# datasheet peaks: dense BF16 tensor TFLOPS and HBM bandwidth in TB/s (SXM parts)
GPU_PEAKS = {"H800": (989.0, 3.35), "H100": (989.0, 3.35), "H20": (148.0, 4.0), "H200": (989.0, 4.8)}
TRAIN_MFU = 0.35  # the update's share of the peak (assumed: bench/gpu_megatron_smoke.sh measures it on one GPU)
DECODE_BANDWIDTH = 0.6  # share of the memory bandwidth a decode step reaches (assumed)
DECODE_FLOPS = 0.5  # share of the peak a large decode batch reaches (assumed)
MEAN_PROMPT_TOKENS = 256  # a math problem with the chat template (assumed; DAPO-Math-17k's are shorter)


@dataclass(frozen=True)
class PoolSplit:
    """One step's work on the two pools, in seconds, and what follows from it."""

    generation_s: float
    update_s: float
    engine_tokens_per_s: float
    sequences_per_engine: int  # decoded at once (the round's share, up to what the KV cache holds)
    train_nodes: int
    rollout_nodes: int
    mean_response_tokens: int

    @property
    def balanced_ratio(self) -> float:
        """Rollout nodes per training node at which generation and update take equally long."""
        return self.generation_s * self.rollout_nodes / self.update_s / self.train_nodes

    def idle(self, stream: bool) -> tuple[float, float]:
        """The training pool's and the rollout pool's idle share of a step: in turns (sync), or
        overlapped (stream: the step is the longer of the two)."""
        step = max(self.generation_s, self.update_s) if stream else self.generation_s + self.update_s
        return 1 - self.update_s / step, 1 - self.generation_s / step


def update_seconds(cfg: Config, arch: Architecture, mean_response: int) -> float:
    """The training pool's share of a step: FLOPs of the batch over its GPUs at TRAIN_MFU."""
    tokens = cfg.data.train_batch_size * cfg.rollout.n * (MEAN_PROMPT_TOKENS + mean_response)
    passes = 6 * cfg.actor.ppo_epochs + 2 + (2 if needs_reference(cfg) else 0)
    flops = passes * arch.total_params() * tokens
    peak, _ = GPU_PEAKS[cfg.trainer.gpu_model or "H800"]
    return flops / (cfg.actor.num_workers * peak * 1e12 * TRAIN_MFU)


def engine_tokens_per_s(cfg: Config, arch: Architecture, memory: GenerationMemory, batch: int, mean_response: int):
    """One engine's decode throughput at ``batch`` sequences of mean context, per the roofline."""
    peak, bandwidth = GPU_PEAKS[cfg.trainer.rollout_pool.gpu_model or cfg.trainer.gpu_model or "H800"]
    tp = cfg.rollout.tensor_parallel_size
    context = MEAN_PROMPT_TOKENS + mean_response / 2
    bytes_read = memory.weights * 2**30 + batch * context * memory.kv_bytes_per_token
    read_s = bytes_read / (bandwidth * 1e12 * DECODE_BANDWIDTH)
    compute_s = 2 * arch.total_params() / tp * batch / (peak * 1e12 * DECODE_FLOPS)
    return batch / max(read_s, compute_s)


def pool_split(cfg: Config, arch: Architecture, memory: GenerationMemory, mean_response: int | None) -> PoolSplit:
    """The estimate for ``cfg``'s two pools (``mean_response``: None assumes a quarter of the budget)."""
    mean_response = mean_response or cfg.data.max_response_length // 4
    engines = cfg.rollout.num_workers or 1
    sequences = cfg.data.effective_gen_batch_size * cfg.rollout.n
    fits = max(memory.kv_tokens // (MEAN_PROMPT_TOKENS + mean_response), 1)
    batch = min(-(-sequences // engines), fits)
    per_engine = engine_tokens_per_s(cfg, arch, memory, batch, mean_response)
    generation_s = sequences * mean_response / (per_engine * engines)
    return PoolSplit(
        generation_s=generation_s,
        update_s=update_seconds(cfg, arch, mean_response),
        engine_tokens_per_s=per_engine,
        sequences_per_engine=batch,
        train_nodes=cfg.trainer.nnodes,
        rollout_nodes=cfg.trainer.rollout_pool.nnodes,
        mean_response_tokens=mean_response,
    )


def describe(split: PoolSplit, cfg: Config) -> list[str]:
    """The plan's lines for the two pools."""
    pool, trainer = cfg.trainer.rollout_pool, cfg.trainer
    train_gpu, rollout_gpu = trainer.gpu_model or "H800", pool.gpu_model or trainer.gpu_model or "H800"
    sync_idle, stream_idle = split.idle(stream=False), split.idle(stream=True)
    assumed = ", ".join(f"{gpu} {GPU_PEAKS[gpu][0]:g} TFLOPS / {GPU_PEAKS[gpu][1]:g} TB/s"
                        for gpu in dict.fromkeys((train_gpu, rollout_gpu)))  # fmt: skip
    engines = f"{cfg.rollout.num_workers} engines of TP {cfg.rollout.tensor_parallel_size}"
    return [
        f"pools       training {trainer.nnodes} x {trainer.n_gpus_per_node} {train_gpu}, rollout {pool.nnodes} x "
        f"{pool.n_gpus_per_node} {rollout_gpu} ({engines})",
        f"  assumed                            {assumed}; training MFU {TRAIN_MFU:g}; decode at "
        f"{DECODE_BANDWIDTH:g} of the bandwidth, {DECODE_FLOPS:g} of the FLOPs; mean prompt {MEAN_PROMPT_TOKENS}, "
        f"response {split.mean_response_tokens} tokens (--mean-response-tokens): an estimate, not a measurement",
        f"  generation per step                {split.generation_s:7.0f} s ({split.sequences_per_engine} sequences "
        f"at once per engine, {split.engine_tokens_per_s:.0f} tokens/s each)",
        f"  update per step                    {split.update_s:7.0f} s",
        f"  balance                            {split.balanced_ratio:.2f} rollout nodes per training node keep both "
        f"busy (this layout: {pool.nnodes / trainer.nnodes:.2f})",
        f"  idle share, training / rollout     sync {sync_idle[0]:.0%} / {sync_idle[1]:.0%}, "
        f"stream {stream_idle[0]:.0%} / {stream_idle[1]:.0%}",
    ]
