"""Per-GPU memory of a Megatron training layout and of the vLLM engines: the formulas of `plan`.

Estimates, not measurements: they answer "can this layout fit at all, and where does the
memory go" before a 128-GPU job is queued. Conventions (bytes; ``e`` = bytes of model.dtype):

- Weights ``e``/param; gradients 4/param (Megatron accumulates and reduces bf16 models' grads
  in fp32); optimizer 12/param (fp32 master + Adam m + v; 8 when the model is fp32), divided
  by DP with the distributed optimizer (by expert DP for expert weights).
- Parameters per GPU: the heaviest pipeline stage, ceil(layers / PP) layers, plus the
  embedding and the LM head (both counted when PP > 1: an upper bound for either end).
  Attention/MLP matrices and the vocabulary are split over TP, experts over EP x ETP; norms
  and routers are replicated.
- Activations per token per layer (flash attention, so no sequence^2 term):
  ``e * (4h / TP_sp + (2 q + 2 kv + mlp) / TP)`` with ``4h`` the inputs of the two norms and
  of the QKV and first MLP projections (split over TP only with sequence parallelism),
  ``q`` / ``kv`` the query / key-value widths (q, k, v after RoPE + attention output) and
  ``mlp`` = ``3 F`` (gate, up, gate*up) or ``k (h + 3 F_moe)`` for top-k experts.
- Tokens per micro-batch per GPU: max(actor.max_token_len_per_micro_batch, prompt + response)
  / CP (a sequence longer than the budget still forms its own micro-batch).
- 1F1B keeps PP micro-batches in flight on the first stage, i.e. the activations of all
  ``layers`` for one micro-batch, times ``1 + (PP - 1) / (PP * VPP)`` with interleaving.
- Recompute: ``selective`` (core attention) saves nothing over flash attention; ``full``
  stores only each layer's input (``e h / TP_sp`` per token) plus one layer recomputed.
- Logits of the last stage: tokens x vocab / TP x (e + 4 + 4): logits, their fp32 copy and
  the fp32 softmax kept for backward.
- vLLM: weights / rollout TP, KV cache = layers x KV heads per GPU x head_dim x 2 (K and V) x e
  per token, in ``gpu_memory_utilization`` x GPU memory minus weights and the reserve.
- ``reserve``: CUDA context, NCCL buffers and allocator fragmentation, per phase.
- A KL reference model (``actor.use_kl_loss`` / ``algorithm.use_kl_in_reward``) is built frozen
  in the actor's layout: colocated it adds its weights, ``e``/param, to every GPU in both phases;
  on separate GPUs it takes none of the actor's.
- Colocated (``trainer.colocate``), the two phases take turns on each GPU: the update runs
  while the engines sleep (level 1 frees their weights and KV cache), and generation runs
  beside the training state that stays resident (weights, gradient buffers, optimizer; no
  offload), so vLLM's ``gpu_memory_utilization`` share must fit next to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nemo_dapo.algo.logprob import chunk_tokens_for
from nemo_dapo.config.architecture import Architecture
from nemo_dapo.config.schema import Config
from nemo_dapo.config.topology import Parallelism, is_colocated, needs_reference, training_world_size

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GRAD_BYTES = 4
ADAM_MOMENT_BYTES = 8


@dataclass(frozen=True)
class Layout:
    """The training ranks as the memory model sees them: the split (:class:`Parallelism`), how
    many ranks, and the settings that change what a rank holds."""

    world: int
    parallel: Parallelism
    sequence_parallel: bool
    distributed_optimizer: bool
    recompute: str | None

    @property
    def dp(self) -> int:
        p = self.parallel
        return self.world // (p.tensor * p.pipeline * p.context)

    @property
    def expert_dp(self) -> int:
        p = self.parallel
        return self.world // (p.etp * p.expert * p.pipeline)


def layout_of(cfg: Config) -> Layout:
    """The megatron layout; the torch backend is plain data parallelism with a replicated optimizer."""
    parallel = Parallelism.of_config(cfg)
    if cfg.actor.backend == "torch":
        return Layout(cfg.actor.num_workers, parallel, False, False, None)
    mg = cfg.actor.megatron
    return Layout(
        training_world_size(cfg), parallel, mg.sequence_parallel, mg.use_distributed_optimizer, mg.recompute_granularity
    )


@dataclass(frozen=True)
class StageParams:
    """Parameters on one GPU of the heaviest pipeline stage."""

    dense: float  # replicated over DP (attention, dense MLP, norms, router, embedding, head)
    expert: float  # replicated over expert DP

    @property
    def total(self) -> float:
        return self.dense + self.expert


def stage_params(arch: Architecture, layout: Layout) -> StageParams:
    split = layout.parallel
    layers = math.ceil(arch.num_layers / split.pipeline)
    per_layer = (arch.attention_params() + arch.mlp_params()) / split.tensor + arch.norm_params() + arch.router_params()
    head = arch.vocab_size * arch.hidden_size if split.pipeline > 1 else arch.output_params() - arch.hidden_size
    ends = (arch.embedding_params() + head) / split.tensor + arch.hidden_size
    return StageParams(
        dense=layers * per_layer + ends,
        expert=layers * arch.expert_params() / (split.expert * split.etp),
    )


def tokens_per_micro_batch(cfg: Config, layout: Layout) -> float:
    split = layout.parallel
    longest = cfg.data.max_sequence_length
    return max(cfg.actor.max_token_len_per_micro_batch, longest) / split.context


def layer_activation_bytes(arch: Architecture, layout: Layout, elt: int) -> float:
    """Bytes one token leaves in one layer for backward, on one GPU (no recompute)."""
    tp = layout.parallel.tensor
    h = arch.hidden_size
    mlp = arch.experts_per_token * (h + 3 * arch.moe_intermediate_size) if arch.is_moe else 3 * arch.intermediate_size
    split = 2 * arch.q_width + 2 * arch.kv_width + mlp
    replicated = 4 * h / (tp if layout.sequence_parallel else 1)
    return elt * (replicated + split / tp)


def in_flight_layers(arch: Architecture, layout: Layout) -> float:
    """Layer-activations the first pipeline stage stashes under (interleaved) 1F1B."""
    split = layout.parallel
    interleave = 1 + (split.pipeline - 1) / (split.pipeline * split.virtual) if split.virtual else 1.0
    return arch.num_layers * interleave


def activation_bytes(arch: Architecture, layout: Layout, tokens: float, elt: int) -> dict[str, float]:
    """Activation memory per GPU for each recompute granularity (``none`` = no recompute)."""
    split = layout.parallel
    per_layer = tokens * layer_activation_bytes(arch, layout, elt)
    stored = in_flight_layers(arch, layout) * per_layer
    checkpoint = tokens * elt * arch.hidden_size / (split.tensor if layout.sequence_parallel else 1)
    full = in_flight_layers(arch, layout) * checkpoint + per_layer
    return {"none": stored, "selective": stored, "full": full}


def logits_bytes(arch: Architecture, layout: Layout, tokens: float, elt: int, chunk_tokens: int | None = None) -> float:
    """The output layer's logits alive at once: one chunk of response positions (the workers score
    ``actor.logits_chunk_tokens`` at a time, see :func:`nemo_dapo.algo.logprob.chunked_token_stats`),
    with their fp32 copy and softmax."""
    split = layout.parallel
    columns = arch.vocab_size / split.tensor
    chunk = chunk_tokens or chunk_tokens_for(math.ceil(columns))
    return min(tokens, chunk) * columns * (elt + 4 + 4)


@dataclass(frozen=True)
class TrainingMemory:
    """GiB per GPU during the update (the heaviest stage)."""

    params: float  # count, not GiB
    weights: float
    gradients: float
    optimizer: float
    activations: dict[str, float]  # by recompute granularity
    recompute: str
    logits: float
    reserve: float
    reference: float = 0.0  # the KL reference model's weights when it shares the GPUs (colocated)

    @property
    def resident(self) -> float:
        """What stays on the GPU between updates: weights, gradient buffers, optimizer state (and a
        colocated reference model's weights)."""
        return self.weights + self.gradients + self.optimizer + self.reference

    @property
    def total(self) -> float:
        return self.resident + self.activations[self.recompute] + self.logits + self.reserve


def training_memory(cfg: Config, arch: Architecture, reserve_gib: float) -> TrainingMemory:
    layout, elt = layout_of(cfg), DTYPE_BYTES[cfg.model.dtype]
    params = stage_params(arch, layout)
    optimizer_per_param = ADAM_MOMENT_BYTES + (4 if elt != 4 else 0)
    dense_shards = layout.dp if layout.distributed_optimizer else 1
    expert_shards = layout.expert_dp if layout.distributed_optimizer else 1
    optimizer = optimizer_per_param * (params.dense / dense_shards + params.expert / expert_shards)
    tokens = tokens_per_micro_batch(cfg, layout)
    activations = activation_bytes(arch, layout, tokens, elt)
    return TrainingMemory(
        params=params.total,
        weights=params.total * elt / GIB,
        gradients=params.total * GRAD_BYTES / GIB,
        optimizer=optimizer / GIB,
        activations={k: v / GIB for k, v in activations.items()},
        recompute=layout.recompute or "none",
        logits=logits_bytes(arch, layout, tokens, elt, cfg.actor.logits_chunk_tokens) / GIB,
        reserve=reserve_gib,
        # the reference worker is built frozen: weights only, in the same layout as the actor
        reference=params.total * elt / GIB if needs_reference(cfg) and is_colocated(cfg) else 0.0,
    )


@dataclass(frozen=True)
class GenerationMemory:
    """GiB per GPU of one vLLM engine's share, and what its KV cache holds."""

    budget: float  # gpu_memory_utilization x GPU memory
    weights: float
    reserve: float
    kv_bytes_per_token: int
    sequence_tokens: int

    @property
    def kv_cache(self) -> float:
        return self.budget - self.weights - self.reserve

    @property
    def kv_tokens(self) -> int:
        return max(int(self.kv_cache * GIB // self.kv_bytes_per_token), 0)

    @property
    def full_sequences(self) -> int:
        """Full-length (prompt + response) sequences the engine can hold at once."""
        return self.kv_tokens // self.sequence_tokens


# One GPU's memory as CUDA reports it: nvidia-smi's memory.total in MiB (torch's total_memory is
# the same bytes). An "80 GB" H800 or H100 is 81559 MiB = 79.65 GiB, not 80. Sources: the
# nvidia-smi tables in docs/cluster.md ("Capacity planning").
GPU_MEMORY_MIB = {"H800": 81559, "H100": 81559, "H20": 97871, "H200": 143771}


def gpu_memory_gib(model: str) -> float:
    return GPU_MEMORY_MIB[model] / 1024


def kv_heads_per_gpu(arch: Architecture, rollout_tp: int) -> int:
    """vLLM splits KV heads over TP, replicating them when TP exceeds their number."""
    return max(arch.num_kv_heads // rollout_tp, 1)


def generation_memory(cfg: Config, arch: Architecture, gpu_memory_gib: float, reserve_gib: float) -> GenerationMemory:
    elt, rollout_tp = DTYPE_BYTES[cfg.model.dtype], cfg.rollout.tensor_parallel_size
    kv_per_token = arch.num_layers * kv_heads_per_gpu(arch, rollout_tp) * arch.head_dim * 2 * elt
    return GenerationMemory(
        budget=cfg.rollout.gpu_memory_utilization * gpu_memory_gib,
        weights=arch.total_params() * elt / rollout_tp / GIB,
        reserve=reserve_gib,
        kv_bytes_per_token=kv_per_token,
        sequence_tokens=cfg.data.max_sequence_length,
    )


@dataclass(frozen=True)
class ColocatedMemory:
    """GiB per GPU when training ranks and engines share it and take turns."""

    training_phase: float  # the update; the engines sleep
    training_kept: float  # while the engines generate: the training state and the process's reserve
    vllm: float  # the engines' gpu_memory_utilization share

    @property
    def generation_phase(self) -> float:
        return self.training_kept + self.vllm

    @property
    def peak(self) -> float:
        return max(self.training_phase, self.generation_phase)


def colocated_memory(
    training: TrainingMemory, generation: GenerationMemory, grads_released: bool = False
) -> ColocatedMemory:
    """While the engines generate, the training process keeps its state and its own reserve (CUDA
    context, NCCL buffers) beside vLLM's ``gpu_memory_utilization`` share; without its gradient
    buffers when ``actor.megatron.release_grad_buffers`` frees them."""
    kept = training.resident + training.reserve - (training.gradients if grads_released else 0.0)
    return ColocatedMemory(training_phase=training.total, training_kept=kept, vllm=generation.budget)
