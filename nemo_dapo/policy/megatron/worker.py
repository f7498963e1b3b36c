"""PolicyWorker on Megatron-core (TP / PP / EP / CP / DP, distributed optimizer), loaded from an HF folder.

Numerically it is the torch worker's twin: the same log-prob / entropy functions, the same
actor loss with mini-batch-wide token counts (gradients are summed over micro-batches, pipeline
schedules and data-parallel ranks, never averaged), AdamW with the same warm-up, the same
gradient clipping. Every rank of a data-parallel replica (its TP x PP x CP ranks) must be given
the same rows; ``dp_rank`` / ``dp_size`` say how the driver should shard.

Without a GPU it runs on the CPU (gloo, local layer spec, :mod:`~nemo_dapo.policy.megatron.cpu_compat`). With one,
batches move to this rank's GPU, process groups use NCCL, the CPU shims stay off, and
``transformer_impl`` picks the local or the TransformerEngine layer spec (``fp8`` and sequence
parallelism need the latter; its attention takes the padding mask as ``padding_causal``). The GPU
path is exercised only by ``bench/gpu_megatron_smoke.py``. With ``sequence_packing`` micro-batches
are packs (:mod:`packing`) in THD form; the local spec attends with torch SDPA
(:mod:`~nemo_dapo.policy.megatron.attention`), row by row inside a pack.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.correction import CorrectionSettings
from nemo_dapo.algo.logprob import chunk_tokens_for
from nemo_dapo.config.schema_actor import MegatronConfig
from nemo_dapo.config.topology import Parallelism
from nemo_dapo.logs import configure_logging
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
from nemo_dapo.policy.megatron import build, inputs, stages
from nemo_dapo.policy.megatron import model as mm
from nemo_dapo.policy.megatron.convert import model_shape
from nemo_dapo.policy.megatron.cpu_compat import enable_cpu_compat
from nemo_dapo.policy.megatron.export import is_exporter, iter_hf_weights
from nemo_dapo.policy.megatron.router_loss import load_balancing_metric, per_routed_token
from nemo_dapo.policy.microbatch import ROUTED_EXPERTS, MicroBatch, RowStats, prompt_width
from nemo_dapo.policy.routing import place_micro_routing, routing_dtype
from nemo_dapo.policy.update_loop import run_update
from nemo_dapo.policy.weight_sender import WeightSender
from nemo_dapo.policy.weights import WEIGHT_BUCKET_BYTES, Bucket, bucketize
from nemo_dapo.threads import use_cpu_threads


def finalize_grads_without_token_scaling(model, num_tokens=None, **kwargs) -> None:
    """Megatron's grad finalisation (DP reduce, tied-embedding sync) minus its 1/num_tokens scaling:
    the actor loss already divides by the mini-batch-wide token count."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


class MegatronPolicyWorker(WeightSender):
    """A :class:`~nemo_dapo.policy.base.PolicyWorker` on megatron-core, the torch worker's twin
    in every number it returns. One rank of a TP x PP x CP x EP x DP layout: every rank of a
    data-parallel replica must be given the same rows (:meth:`data_parallel_layout`); its inputs
    are built by :mod:`~nemo_dapo.policy.megatron.inputs`, its model and optimizer by
    :mod:`~nemo_dapo.policy.megatron.build`, its checkpoints written by
    :mod:`~nemo_dapo.policy.megatron.checkpoint` through the ``CheckpointedWorker`` view."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        rendezvous: str,
        settings: WorkerSettings,
        layout: MegatronConfig | None = None,
    ) -> None:
        """``layout`` is ``actor.megatron`` (validated with the whole config at start-up; only what
        the config cannot know, a GPU and TransformerEngine here, is checked on the rank)."""
        from transformers import AutoConfig

        configure_logging()
        use_cpu_threads(settings.num_threads, settings.workers_per_node or world_size, f"Megatron policy worker {rank}")
        self.layout = layout = layout or MegatronConfig()
        mm.require_runtime(layout)
        enable_cpu_compat()  # no-op when a GPU is present
        self.rank, self.world_size = rank, world_size
        self.parallel = Parallelism.of(layout)
        mm.init_distributed(rank, world_size, rendezvous, self.parallel, settings.seed)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        torch.manual_seed(settings.seed + rank)
        self.hf_config = AutoConfig.from_pretrained(settings.model_path)
        self.shape = model_shape(self.hf_config)
        self.config = mm.transformer_config(self.hf_config, DTYPES[settings.dtype], layout)
        self.config.finalize_model_grads_func = finalize_grads_without_token_scaling
        self.optim_cfg = settings.optim
        self.lr_factor = lr_lambda(self.optim_cfg, settings.total_steps)
        self.max_token_len = settings.max_token_len
        columns = mm.padded_vocab_size(self.shape.vocab_size, self.parallel.tensor) // self.parallel.tensor
        self.chunk_tokens = settings.logits_chunk_tokens or chunk_tokens_for(columns)
        self.steps_done = 0
        self.trainable = settings.trainable
        built = build.build_chunks(settings.model_path, self.hf_config, self.config, self.shape, layout, self.device)
        self.models, self.output = built.models, built.output
        self.replay = self._routing_replay()
        self.optimizer = None
        if self.trainable:
            self.chunks = build.wrap_for_training(self.models, self.config, layout)
            self.optimizer = build.build_optimizer(self.chunks, self.optim_cfg, layout, self.config)
        else:  # a reference model: weights only, no gradient buffers or optimizer state
            self.chunks = self.models
            for model in self.models:
                model.requires_grad_(False)

    def _routing_replay(self):
        """The MoE routers' replay hooks (``actor.megatron.router_replay``; docs/moe.md), or None."""
        mode = self.layout.router_replay
        if mode == "none":
            return None
        if not self.shape.num_experts:
            raise ValueError(
                f"actor.megatron.router_replay={mode}: the model has no experts (a dense model routes nothing); "
                "set it to none"
            )
        from nemo_dapo.policy.megatron.router_replay import RoutingReplay

        return RoutingReplay(
            self.models,
            self.shape.num_layers,
            self.shape.experts_per_token,
            self.layout.sequence_parallel,
            recompute=self.layout.recompute_granularity == "full",
        )

    def gather_params(self) -> None:
        """With overlapped parameter gathers, the other ranks' shards of an update arrive in the next
        forward; readers of the weights outside a forward (export, checkpoint) gather them now."""
        if self.trainable and self.layout.overlap_param_gather:
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    def ready(self) -> bool:
        return True

    # ---- forward ---------------------------------------------------------------------------

    def _stats(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float, entropy_grad: bool):
        """Log-probs and entropy of ``labels`` from this rank's vocabulary columns, computed from the
        final hidden states in chunks (:class:`DeferredOutputLayer`)."""
        assert self.output is not None, "only the last pipeline stage computes log-probs"
        return self.output.response_stats(
            hidden, labels, temperature, self.shape.vocab_size, entropy_grad, self.chunk_tokens
        )

    def _response_stats(self, micro: MicroBatch, hidden: torch.Tensor, temperature: float, entropy_grad: bool = True):
        """Log-probs and entropy of ``micro``'s response tokens, in [rows, response] form."""
        return inputs.response_stats(
            micro, hidden, lambda states, labels: self._stats(states, labels, temperature, entropy_grad)
        )

    @property
    def width_multiple(self) -> int:
        return inputs.layout_width_multiple(self.layout, self.parallel)

    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list[MicroBatch]:
        cp_rank = 0
        if self.parallel.context > 1:
            from megatron.core import parallel_state

            cp_rank = parallel_state.get_context_parallel_rank()
        return inputs.split_batch(batch, self.layout, self.parallel, self.max_token_len, cp_rank)

    def _model_inputs(self, micro: MicroBatch) -> dict:
        te = self.layout.transformer_impl == "transformer_engine"
        return inputs.model_inputs(micro, self.width_multiple, te)

    def _set_mode(self, train: bool) -> None:
        for chunk in self.chunks:
            chunk.train(train)

    def _run_schedule(self, micros: list[MicroBatch], loss_fn, forward_only: bool) -> None:
        """Megatron's forward(-backward) schedule (pipelined when PP > 1) over the micro-batches."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            source = next(data_iterator)
            micro = source.to(self.device)
            chunk = next(i for i, c in enumerate(self.chunks) if c is model)
            if self.replay is not None:
                self.replay.before_forward(chunk, micro, self.width_multiple)
            output = model(**self._model_inputs(micro))
            if self.replay is not None:
                self.replay.after_forward(chunk, micro, self.width_multiple, key=id(source))
            return output, functools.partial(loss_fn, micro)

        shapes = [inputs.input_shape(micro, self.width_multiple) for micro in micros]
        # interleaved: every chunk reads each micro-batch (the loss needs it on the last chunk)
        data = [iter(micros) for _ in self.chunks] if self.parallel.virtual else iter(micros)
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=self.chunks,
            num_microbatches=len(micros),
            seq_length=max(width for _, width in shapes),
            micro_batch_size=shapes[0][0],
            forward_only=forward_only,
        )

    @torch.no_grad()
    def compute_log_prob(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """Log-probs and entropy of the responses. With routing replay: r3 replays the batch's
        ``routed_experts`` and adds ``own_log_probs`` (the trainer's own routing, for the mismatch
        metrics); r2 (policy only) records its routing and returns it as ``routed_experts``."""
        self._set_mode(train=False)
        micros = self._micro_batches(batch)
        mode = self.layout.router_replay if self.replay is not None else "none"
        action = {"r3": "REPLAY_FORWARD", "r2": "RECORD" if self.trainable else None}.get(mode)
        result = self._log_probs(batch, micros, temperature, action)
        if mode == "r2" and self.trainable:
            result[ROUTED_EXPERTS] = self._recorded_routing(batch, micros)
        if mode == "r3" and self.trainable:
            result["own_log_probs"] = self._log_probs(batch, micros, temperature, None)["log_probs"]
        return result

    def _log_probs(
        self, batch: dict[str, torch.Tensor], micros: list, temperature: float, replay_action: str | None
    ) -> dict[str, torch.Tensor]:
        """One forward schedule over ``micros``; ``replay_action`` names a RouterReplayAction (MoE)."""
        if self.replay is not None:
            from nemo_dapo.policy.megatron.router_replay import actions

            self.replay.start(getattr(actions(), replay_action) if replay_action else None)
        stats = RowStats()

        def collect(micro, hidden):
            # uniform micro-batches end with filler rows, which are not among its rows
            stats.add(micro.rows, *self._response_stats(micro, hidden, temperature))
            return hidden.new_zeros(()), torch.tensor(0, dtype=torch.int), {}

        self._run_schedule(micros, collect, forward_only=True)
        mask = batch["loss_mask"].float()
        return {key: value * mask for key, value in self._placed_on_every_stage(stats, batch).items()}

    def _placed_on_every_stage(self, stats: RowStats, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``stats`` in ``batch``'s row order, on every pipeline stage (collective)."""
        return {
            key: stages.from_last_stage(value, self.parallel, self.device)
            for key, value in stats.placed(batch["responses"].shape).items()
        }

    def _recorded_routing(self, batch: dict[str, torch.Tensor], micros: list) -> torch.Tensor:
        """What the recording pass picked, as the batch's [B, P + R, L, K] ``routed_experts``."""
        from nemo_dapo.policy.megatron.router_replay import reduce_recorded

        assert self.replay is not None
        tokens = batch["input_ids"].shape
        shape = (*tokens, self.shape.num_layers, self.shape.experts_per_token)
        parts = [(micro, self.replay.recorded[id(micro)]) for micro in micros if micro.rows.numel()]
        routing = place_micro_routing(shape, prompt_width(batch), parts, torch.int32)
        return reduce_recorded(routing.to(self.device)).cpu().to(routing_dtype(self.shape.num_experts))

    # ---- update ----------------------------------------------------------------------------

    def update(
        self, mini_batches: list[MiniBatch], settings: LossSettings, correction: CorrectionSettings | None = None
    ) -> UpdateResult:
        require_trainable(self.trainable, "update")
        self._hold_grad_buffers(True)
        self._set_mode(train=True)
        return run_update(
            mini_batches,
            lambda mini, forward: self._train_step(mini, settings, correction, forward),
            self._placed_on_every_stage,
        )

    def _train_step(
        self, mini: MiniBatch, settings: LossSettings, correction: CorrectionSettings | None, forward: RowStats | None
    ) -> dict[str, list[float]]:
        """One optimizer step: gradients of every micro-batch summed, clipped, AdamW at this step's lr.
        With ``forward`` (an ``old_from_forward`` mini-batch) the forward's own log-probs are the
        old ones, and are kept there (on the last pipeline stage, which computes the loss)."""
        assert self.optimizer is not None, "update() checked trainable"
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        step_metrics: dict[str, list[float]] = {}

        def loss_fn(micro, hidden):
            log_probs, entropy = self._response_stats(
                micro, hidden, settings.temperature, entropy_grad=settings.entropy_coeff != 0
            )
            loss, micro_metrics = micro_batch_loss(log_probs, entropy, micro, mini, settings, correction, forward)
            for key, value in micro_metrics.items():
                step_metrics.setdefault(key, []).append(value)
            return loss, micro["loss_mask"].sum().int(), {}

        micros = self._micro_batches(mini.data)
        routed = sum(rows * width for rows, width in (inputs.input_shape(m, self.width_multiple) for m in micros))
        if self.replay is not None:
            from nemo_dapo.policy.megatron.router_replay import actions

            self.replay.start(actions().REPLAY_FORWARD)
        with per_routed_token(self.config, routed, self.device):
            self._run_schedule(micros, loss_fn, forward_only=False)
        for group in self.optimizer.param_groups:
            group["lr"] = self.optim_cfg.lr * self.lr_factor(self.steps_done)
        finite = stages.gradients_finite(self.chunks, self.device)
        grad_norm = self.optimizer.step()[1] if finite else float("nan")  # skipped: nothing changes
        self.steps_done += 1
        step_metrics = {
            **stages.share_metrics(step_metrics, self.parallel),
            **load_balancing_metric(self.config, len(micros)),
        }
        if self.replay is not None:
            agreement = self.replay.agreement()
            step_metrics[mn.ROUTER_AGREEMENT["mean"].name] = [agreement["mean"]]
            step_metrics[mn.ROUTER_AGREEMENT["min"].name] = [agreement["min"]]
        step_metrics[mn.GRAD_NORM.name] = [float(grad_norm)]
        step_metrics[mn.SKIPPED_STEPS.name] = [0.0 if finite else 1.0]
        step_metrics[mn.LR.name] = [self.optim_cfg.lr * self.lr_factor(self.steps_done)]
        return step_metrics

    # ---- weights and checkpoints -----------------------------------------------------------

    def data_parallel_layout(self) -> tuple[int, int]:
        """(dp_rank, dp_size): the TP x PP x CP ranks of one replica must get the same rows."""
        return self.dp_rank, self.dp_size

    def exports_weights(self) -> bool:
        return is_exporter()

    def export_weights(self, bucket_bytes: int = WEIGHT_BUCKET_BYTES) -> Iterator[Bucket]:
        """This rank's share of the HF-named tensors in buckets of at most ``bucket_bytes``; collective.

        One rank per pipeline stage yields its stage's layers, gathered over TP one layer at a time
        (:mod:`~nemo_dapo.policy.megatron.export`); every other rank takes part in the gathers and yields nothing.
        """
        self.gather_params()
        yield from bucketize(iter_hf_weights(self.models, self.shape), bucket_bytes)

    def save(self, path: str, asynchronous: bool = False) -> None:
        from nemo_dapo.policy.megatron.checkpoint import save_checkpoint

        require_trainable(self.trainable, "save")
        save_checkpoint(self, path, asynchronous)

    @functools.cached_property
    def async_saves(self):
        """megatron-core's queue of background checkpoint writes (one forked writer per save)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        return AsyncCallsQueue()

    @functools.cached_property
    def background_writes(self):
        """The thread writing the HF copy of an asynchronous checkpoint."""
        from nemo_dapo.policy.megatron.checkpoint import BackgroundWrites

        return BackgroundWrites()

    def finish_save(self, blocking: bool = True) -> bool:
        from nemo_dapo.policy.megatron.checkpoint import finish_async_saves

        return finish_async_saves(self, blocking)

    def release_memory(self) -> int:
        """The allocator's cached blocks, and with ``actor.megatron.release_grad_buffers`` the
        gradient buffers (back, zeroed, when the next update starts)."""
        if self.trainable:
            self._hold_grad_buffers(False)
        return release_cached_gpu_memory()

    def _hold_grad_buffers(self, held: bool) -> None:
        """With ``actor.megatron.release_grad_buffers``: bring the gradient buffers back (zeroed) or
        free them; megatron-core keeps their sizes, and each call is a no-op when already done."""
        if not self.layout.release_grad_buffers:
            return
        synchronize = self.device.type == "cuda"
        for chunk in self.chunks:
            if held:
                chunk.restore_grad_buffers(synchronize=synchronize)
            else:
                chunk.offload_grad_buffers(synchronize=synchronize, empty_cache=False)

    def load(self, path: str) -> None:
        from nemo_dapo.policy.megatron.checkpoint import load_checkpoint

        require_trainable(self.trainable, "load")
        load_checkpoint(self, path)
