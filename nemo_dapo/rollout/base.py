"""The RolloutWorker interface: engine-agnostic generation with per-token log-probs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


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


class RolloutWorker(Protocol):
    def ready(self) -> bool: ...

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[Generation]: ...

    def update_weights(self, buckets: Iterable[list[tuple]], version: int) -> int:
        """Load HF-named tensors into the running engine; returns the engine's weight version."""

    def receive_weights(self, queue, version: int) -> int:
        """:meth:`update_weights` from buckets that arrive on a Ray queue (``[ref]`` items, ``None`` ends)."""

    def weight_version(self) -> int: ...

    def sleep(self) -> None:
        """Free the engine's device memory while training ranks share its GPUs (a documented no-op
        where the engine or the layout has no use for it)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back (``tags``: weights, kv_cache; None: all) before syncing or generating."""
