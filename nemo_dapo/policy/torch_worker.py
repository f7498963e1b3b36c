"""PolicyWorker on a Hugging Face transformers model (single process or data parallel over gloo).

Data parallelism is explicit: every rank computes gradients of its shard with the
mini-batch-wide token counts, then gradients are summed with ``all_reduce`` (no averaging),
which makes the update exactly that of the un-split mini-batch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.correction import CorrectionSettings
from nemo_dapo.algo.logprob import chunk_tokens_for, chunked_token_stats, token_stats
from nemo_dapo.logs import configure_logging
from nemo_dapo.network import join_group
from nemo_dapo.policy.actor_loss import micro_batch_loss
from nemo_dapo.policy.base import (
    DTYPES,
    LossSettings,
    MiniBatch,
    UpdateResult,
    WorkerSettings,
    release_cached_gpu_memory,
    require_trainable,
)
from nemo_dapo.policy.lr_schedule import lr_lambda
from nemo_dapo.policy.microbatch import MicroBatch, RowStats, micro_batches
from nemo_dapo.policy.shared_prompt import hidden_before_responses
from nemo_dapo.policy.update_loop import run_update
from nemo_dapo.policy.weight_sender import WeightSender
from nemo_dapo.policy.weights import WEIGHT_BUCKET_BYTES, Bucket, bucketize
from nemo_dapo.rng import restore_rng, rng_state
from nemo_dapo.safe_load import load_state
from nemo_dapo.threads import use_cpu_threads


def init_data_parallel(rank: int, world_size: int, rendezvous: str) -> None:
    """A gloo group of the data-parallel ranks (:func:`~nemo_dapo.network.join_group`); none for one rank."""
    if world_size > 1:
        join_group(rank, world_size, rendezvous, backend="gloo")


class TorchPolicyWorker(WeightSender):
    """A :class:`~nemo_dapo.policy.base.PolicyWorker` on a Hugging Face model and plain torch:
    one data-parallel replica per rank (gradients summed over ranks with gloo / NCCL), fp32
    master weights with autocast to ``dtype``. Its contract is the interface's: scores rows
    (:meth:`compute_log_prob`), takes one optimizer step per mini-batch (:meth:`update`),
    streams its weights as HF-named buckets, saves and loads its own state."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        rendezvous: str,
        settings: WorkerSettings,
        attn_implementation: str = "sdpa",
        shared_prompt_forward: bool = True,
    ) -> None:
        """``settings.dtype`` is the compute precision: the parameters, their gradients and the
        optimizer stay fp32 (the master copy), matmuls run in ``dtype`` under autocast, and the
        log-prob and entropy reductions are fp32 whatever ``dtype`` is. ``shared_prompt_forward``:
        each distinct prompt of a micro-batch through the decoder once
        (:mod:`~nemo_dapo.policy.shared_prompt`)."""
        from transformers import AutoModelForCausalLM

        configure_logging()
        use_cpu_threads(settings.num_threads, settings.workers_per_node or world_size, f"torch policy worker {rank}")
        self.rank, self.world_size = rank, world_size
        init_data_parallel(rank, world_size, rendezvous)
        torch.manual_seed(settings.seed + rank)
        self.model = AutoModelForCausalLM.from_pretrained(
            settings.model_path, dtype=torch.float32, attn_implementation=attn_implementation
        )
        self.model.config.use_cache = False
        self.compute_dtype = DTYPES[settings.dtype]
        self.chunk_tokens = settings.logits_chunk_tokens or chunk_tokens_for(
            self.model.get_output_embeddings().weight.shape[0]
        )
        self.optim_cfg = optim = settings.optim
        self.trainable = settings.trainable
        self.model.requires_grad_(self.trainable)  # a reference model (trainable=False) never updates
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            betas=(optim.betas[0], optim.betas[1]),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=True,  # one kernel over all parameters instead of a loop of small ops per tensor
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, settings.total_steps))
        self.max_token_len = settings.max_token_len
        self.shared_prompt_forward = shared_prompt_forward

    def ready(self) -> bool:
        return True

    def _compute_precision(self):
        """Autocast to ``dtype`` for a whole call or mini-batch, not per micro-batch: autocast casts
        each fp32 weight once per context and reuses the copy, so one context over all micro-batches
        casts the model once (per micro-batch, the casts cost as much as the bf16 matmuls saved)."""
        low_precision = self.compute_dtype != torch.float32
        return torch.autocast(self.model.device.type, dtype=self.compute_dtype, enabled=low_precision)

    def _forward(
        self, micro: MicroBatch, temperature: float, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy of the response tokens (inside :meth:`_compute_precision`); the
        entropy carries gradients only with ``entropy_grad`` (an entropy bonus in the loss).

        The decoder runs once (each distinct prompt once, :func:`hidden_before_responses`); the
        output layer only at the response positions, in chunks
        (:func:`~nemo_dapo.algo.logprob.chunked_token_stats`), so no ``[tokens, vocab]`` logits of
        the whole micro-batch are ever alive."""
        return chunked_token_stats(
            hidden_before_responses(self.model.base_model, micro, self.shared_prompt_forward),
            micro["responses"],
            self.model.get_output_embeddings(),
            functools.partial(token_stats, temperature=temperature, entropy_grad=entropy_grad),
            self.chunk_tokens,
        )

    @torch.no_grad()
    def compute_log_prob(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> dict[str, torch.Tensor]:
        self.model.eval()
        stats = RowStats()
        with self._compute_precision():
            for micro in micro_batches(batch, self.max_token_len, self.shared_prompt_forward):
                stats.add(micro.rows, *self._forward(micro, temperature))
        mask = batch["loss_mask"].float()
        return {key: value * mask for key, value in stats.placed(batch["responses"].shape).items()}

    def update(
        self, mini_batches: list[MiniBatch], settings: LossSettings, correction: CorrectionSettings | None = None
    ) -> UpdateResult:
        require_trainable(self.trainable, "update")
        self.model.train()
        result = run_update(
            mini_batches,
            lambda mini, forward: self._train_step(mini, settings, correction, forward),
            lambda stats, data: stats.placed(data["responses"].shape),
        )
        # nothing reads the gradients after the last step: freed now, their memory (the size of the
        # fp32 weights) serves generation, the weight export and a checkpoint's buffers instead
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def _train_step(
        self, mini: MiniBatch, settings: LossSettings, correction: CorrectionSettings | None, forward: RowStats | None
    ) -> dict[str, list[float]]:
        """One optimizer step: gradients of every micro-batch summed over micro-batches and ranks,
        clipped, AdamW at this step's lr; a non-finite gradient norm skips the step."""
        self.optimizer.zero_grad(set_to_none=True)
        step_metrics = self._accumulate_gradients(mini, settings, correction, forward)
        self._all_reduce_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.clip_grad)
        finite = bool(torch.isfinite(grad_norm))  # the same on every rank: the gradients are reduced
        if finite:
            self.optimizer.step()
        self.scheduler.step()
        step_metrics[mn.SKIPPED_STEPS.name] = [0.0 if finite else 1.0]
        step_metrics[mn.GRAD_NORM.name] = [float(grad_norm)]
        step_metrics[mn.LR.name] = [float(self.scheduler.get_last_lr()[0])]
        return step_metrics

    def _accumulate_gradients(
        self,
        mini: MiniBatch,
        settings: LossSettings,
        correction: CorrectionSettings | None,
        forward: RowStats | None,
    ) -> dict[str, list[float]]:
        """Backward of every micro-batch of ``mini``; with ``forward`` (an ``old_from_forward``
        mini-batch) the forward's own log-probs are the old ones, and are kept there."""
        step_metrics: dict[str, list[float]] = {}
        with self._compute_precision():
            for micro in micro_batches(mini.data, self.max_token_len, self.shared_prompt_forward):
                log_probs, entropy = self._forward(micro, settings.temperature, settings.entropy_coeff != 0)
                loss, micro_metrics = micro_batch_loss(log_probs, entropy, micro, mini, settings, correction, forward)
                loss.backward()
                for key, value in micro_metrics.items():
                    step_metrics.setdefault(key, []).append(value)
        return step_metrics

    def _all_reduce_gradients(self) -> None:
        if self.world_size == 1:
            return
        for param in self.model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)

    def data_parallel_layout(self) -> tuple[int, int]:
        """(dp_rank, dp_size): every rank is its own data-parallel replica here."""
        return self.rank, self.world_size

    def exports_weights(self) -> bool:
        return self.rank == 0

    def export_weights(self, bucket_bytes: int = WEIGHT_BUCKET_BYTES) -> Iterator[Bucket]:
        """Rank 0's weights in buckets (every rank holds the same copy; the others yield nothing), in
        the compute dtype the engines run in: the fp32 master copy stays here, and a bf16 engine gets
        half the bytes instead of casting fp32 on arrival. Tied weights go under each of their names:
        vLLM's in-place reload re-initialises a layer it is given no weight for."""
        if self.exports_weights():
            weights = self.model.state_dict().items()
            yield from bucketize(((name, self._for_engines(tensor)) for name, tensor in weights), bucket_bytes)

    def _for_engines(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to(dtype, copy=True)

    def state(self) -> dict:
        """Optimizer, scheduler and RNG state of this rank (weights are saved separately)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
        }

    def save(self, path: str, asynchronous: bool = False) -> None:
        """Rank 0 writes the HF weights and the (replicated) optimizer state; others write RNG only.
        Always synchronous (the config refuses ``checkpoint.async_save`` with this backend)."""
        os.makedirs(path, exist_ok=True)
        state = self.state()
        if self.rank == 0:
            self.model.save_pretrained(os.path.join(path, "model"), safe_serialization=True)
            torch.save({k: state[k] for k in ("optimizer", "scheduler")}, os.path.join(path, "optim.pt"))
        torch.save(state["rng"], os.path.join(path, f"rng_rank{self.rank}.pt"))

    def finish_save(self, blocking: bool = True) -> bool:
        return True  # nothing runs in the background

    def release_memory(self) -> int:
        return release_cached_gpu_memory()

    def load(self, path: str) -> None:
        """Load weights + optimizer; works for any number of DP ranks (the state is replicated)."""
        from transformers import AutoModelForCausalLM

        # through transformers: it maps the checkpoint's names to the in-memory ones (MoE experts
        # are per-expert on disk, fused in memory) and checks the architecture
        saved = AutoModelForCausalLM.from_pretrained(os.path.join(path, "model"), dtype=torch.float32)
        try:
            self.model.load_state_dict(saved.state_dict())
        except RuntimeError as err:
            raise RuntimeError(f"checkpoint {path} does not match the model: {err}") from None
        state = load_state(os.path.join(path, "optim.pt"))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        rng_file = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_file):  # absent when resuming with more ranks than were saved
            restore_rng(load_state(rng_file))
