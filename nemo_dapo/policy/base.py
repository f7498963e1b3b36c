"""The PolicyWorker interface every training backend implements (docs/architecture.md).

One worker per training rank. Batches travel as plain dicts of tensors
(:func:`~nemo_dapo.policy.inputs.worker_inputs`), all [B, ...] with ``input_ids`` = left-padded
prompt + right-padded response ([B, P + R]), ``attention_mask`` / ``position_ids`` the same
shape, and ``responses`` / ``loss_mask`` (the tokens the loss sees) and the loss's other inputs
([B, R]) the response part. The driver-side group shards rows over data-parallel ranks; a worker
cuts its rows into typed :class:`~nemo_dapo.policy.microbatch.MicroBatch` es.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from nemo_dapo.algo.correction import CorrectionSettings
from nemo_dapo.config.schema_actor import OptimConfig
from nemo_dapo.policy.weights import WEIGHT_BUCKET_BYTES

# model.dtype names -> the compute dtype of either backend
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WorkerSettings:
    """What every policy worker is built from, whatever its backend (the trainer fills it from the
    config; a backend's own settings are its constructor's other arguments).

    ``dtype``: the compute precision (``model.dtype``); weights, gradients and the optimizer stay
    fp32. ``total_steps``: optimizer steps of the whole run (the learning-rate schedule's length).
    ``max_token_len``: the token budget of a micro-batch. ``logits_chunk_tokens``: response tokens
    per output-layer chunk (None: sized from the vocabulary). ``seed``: each rank seeds
    ``seed + rank``. ``trainable``: False for a reference model (no optimizer, never updated).
    ``num_threads`` / ``workers_per_node``: this worker's CPU threads, or its share of the node's
    cores among the workers computing beside it."""

    model_path: str
    optim: OptimConfig = field(default_factory=OptimConfig)
    dtype: str = "float32"
    total_steps: int = 1000
    max_token_len: int = 16384
    logits_chunk_tokens: int | None = None
    seed: int = 1
    trainable: bool = True
    num_threads: int | None = None
    workers_per_node: int | None = None


@dataclass(frozen=True)
class LossSettings:
    """Everything the actor loss reads from config (docs/algorithm.md §1-2, §4, §7)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 10.0
    loss_agg_mode: str = "token-mean"
    policy_loss: str = "dapo"  # a name in nemo_dapo.algo.policy_losses (or "module:name")
    norm_constant: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_type: str = "ppo_clip"  # ppo_clip | reinforce (bypass mode)
    bypass_mode: bool = False
    temperature: float = 1.0


@dataclass
class MiniBatch:
    """One optimizer step's share of data on one rank, with the mini-batch-wide counts.

    ``old_from_forward``: this mini-batch's old log-probs are the ones its own training forward
    computes (detached), not ``data["old_log_probs"]``. Exact for the first optimizer step of a
    batch, whose forward runs on the weights that would have scored it (docs/algorithm.md §8)."""

    data: dict[str, torch.Tensor]
    global_token_count: float
    global_seq_count: float
    old_from_forward: bool = False


@dataclass
class UpdateResult:
    """What an update returns: its metrics (per optimizer step from a worker, combined from the
    driver-side group), and for the rows of a mini-batch marked ``old_from_forward`` the
    ``log_probs`` and ``entropy`` ([rows, R], in the mini-batch's row order) its forward computed:
    the driver's metrics of the old policy read them as they would the old_log_prob pass's."""

    metrics: dict
    first_forward: dict[str, torch.Tensor] | None = None


def release_cached_gpu_memory() -> int:
    """Hand the CUDA caching allocator's unused blocks back to the device, so that colocated
    engines waking after an update find them free; returns the bytes given back (0 without CUDA)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_reserved()


def require_trainable(trainable: bool, what: str) -> None:
    """A worker built with ``trainable=False`` (the KL reference) keeps weights only."""
    if not trainable:
        raise RuntimeError(
            f"{what}: this worker was built with trainable=False (a reference model): it only computes log-probs"
        )


class PolicyWorker(Protocol):
    """What the driver-side :class:`~nemo_dapo.cluster.groups.PolicyGroup` calls on every rank.

    Both backends (``torch_worker.TorchPolicyWorker``, ``megatron.worker.MegatronPolicyWorker``)
    implement it; the type checker holds them to it (``tests/interfaces_typecheck.py``).
    """

    def ready(self) -> bool: ...

    def data_parallel_layout(self) -> tuple[int, int]:
        """(dp_rank, dp_size): ranks of one model replica (TP x PP x CP) must get the same rows."""
        ...

    def compute_log_prob(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """``log_probs`` and ``entropy`` ([B, R]) of the response tokens under the current weights,
        at the sampling ``temperature``."""
        ...

    def update(
        self, mini_batches: list[MiniBatch], settings: LossSettings, correction: CorrectionSettings | None = None
    ) -> UpdateResult:
        """One optimizer step per mini-batch (the caller repeats the list for ppo_epochs);
        ``correction``: rollout IS / rejection settings the loss applies."""
        ...

    def export_weights(self, bucket_bytes: int = WEIGHT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """This rank's share of the Hugging Face-named tensors in size-bounded buckets (collective).

        A generator: buckets stream out as they are gathered. Over all ranks every tensor is
        yielded exactly once, in rank order the HF order.
        """
        ...

    def open_weight_transfer(self, backend: str, bucket_bytes: int) -> dict | None:
        """An exporting rank's endpoint for the engines on the collective path ``backend`` (None
        on the other ranks); collective where the backend declares the tensors first (nccl)."""
        ...

    def join_weight_transfer(self, world_size: int, timeout_s: float) -> str | None:
        """Meet the engines there; an error's text, or None."""
        ...

    def send_weights(self, bucket_bytes: int) -> dict:
        """Send this rank's export to the engines (collective); ``sent_bytes`` and ``error``."""
        ...

    def close_weight_transfer(self) -> None: ...

    def save(self, path: str, asynchronous: bool = False) -> None:
        """Collective. ``asynchronous``: some files may still be written on return, until
        :meth:`finish_save` says the save is complete."""
        ...

    def finish_save(self, blocking: bool = True) -> bool:
        """Collective: whether every save begun on this worker is completely on disk."""
        ...

    def load(self, path: str) -> None: ...

    def release_memory(self) -> int:
        """Give the GPU memory this rank caches but does not use back to the device (colocated
        engines wake into it after an update); the bytes given back."""
        ...
