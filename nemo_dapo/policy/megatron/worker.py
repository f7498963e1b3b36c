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
import math
import random
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.algo.correction import CorrectionSettings
from nemo_dapo.algo.logprob import chunk_tokens_for
from nemo_dapo.config.schema import MegatronConfig, OptimConfig
from nemo_dapo.logs import configure_logging
from nemo_dapo.policy.actor_loss import actor_loss
from nemo_dapo.policy.base import DTYPES, LossSettings, MiniBatch, UpdateResult, require_trainable
from nemo_dapo.policy.lr_schedule import lr_lambda
from nemo_dapo.policy.megatron import model as mm
from nemo_dapo.policy.megatron.convert import ModelShape
from nemo_dapo.policy.megatron.cpu_compat import enable_cpu_compat
from nemo_dapo.policy.megatron.export import iter_hf_weights
from nemo_dapo.policy.megatron.router_loss import load_balancing_metric, per_routed_token
from nemo_dapo.policy.megatron.vocab import DeferredOutputLayer
from nemo_dapo.policy.microbatch import (
    ROWS,
    RowStats,
    micro_batches,
    prompt_width,
    uniform_micro_batches,
    within_responses,
)
from nemo_dapo.policy.packing import (
    PACKED_IDS,
    context_parallel_share,
    packed_micro_batches,
    response_positions,
    scatter_rows,
    uniform_packs,
)
from nemo_dapo.policy.routing import ROUTED_EXPERTS, place_micro_routing, routing_dtype
from nemo_dapo.policy.weights import Bucket, bucketize
from nemo_dapo.threads import use_cpu_threads


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask (True = blocked): causal, and padding keys blocked."""
    width = attention_mask.shape[1]
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=attention_mask.device), diagonal=1)
    return causal[None, None] | (attention_mask == 0)[:, None, None, :]


def padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """TransformerEngine's ``padding_causal`` input: [b, 1, 1, s], True = padding (causality is TE's)."""
    return (attention_mask == 0)[:, None, None, :]


def pad_width(micro: dict[str, torch.Tensor], multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model inputs right-padded to a width divisible by ``multiple`` (sequence parallelism splits
    the sequence over the TP ranks); padded columns are masked and come after every real token."""
    tokens, positions, mask = micro["input_ids"], micro["position_ids"], micro["attention_mask"]
    extra = -tokens.shape[1] % multiple
    if extra:
        tokens = torch.nn.functional.pad(tokens, (0, extra))
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)], 1)
        mask = torch.nn.functional.pad(mask, (0, extra))
    return tokens, positions, mask


def finalize_grads_without_token_scaling(model, num_tokens=None, **kwargs) -> None:
    """Megatron's grad finalisation (DP reduce, tied-embedding sync) minus its 1/num_tokens scaling:
    the actor loss already divides by the mini-batch-wide token count."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


class MegatronPolicyWorker:
    def __init__(
        self,
        rank: int,
        world_size: int,
        rendezvous: str,
        model_path: str,
        optim: OptimConfig,
        layout: MegatronConfig | None = None,
        dtype: str = "float32",
        total_steps: int = 1000,
        max_token_len: int = 16384,
        seed: int = 1,
        num_threads: int | None = None,
        workers_per_node: int | None = None,
        logits_chunk_tokens: int | None = None,
        trainable: bool = True,
    ) -> None:
        """``layout`` is ``actor.megatron`` (validated with the whole config at start-up; only what
        the config cannot know, a GPU and TransformerEngine here, is checked on the rank)."""
        from transformers import AutoConfig

        configure_logging()
        use_cpu_threads(num_threads, workers_per_node or world_size, f"Megatron policy worker {rank}")
        self.layout = layout = layout or MegatronConfig()
        mm.require_runtime(layout)
        enable_cpu_compat()  # no-op when a GPU is present
        self.rank, self.world_size = rank, world_size
        self.parallel = mm.Parallelism.of(layout)
        mm.init_distributed(rank, world_size, rendezvous, self.parallel, seed)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        torch.manual_seed(seed + rank)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.shape = ModelShape.from_hf_config(self.hf_config)
        self.config = mm.transformer_config(self.hf_config, DTYPES[dtype], layout)
        self.config.finalize_model_grads_func = finalize_grads_without_token_scaling
        self.optim_cfg = optim
        self.lr_factor = lr_lambda(self.optim_cfg, total_steps)
        self.max_token_len = max_token_len
        columns = mm.padded_vocab_size(self.shape.vocab_size, self.parallel.tensor) // self.parallel.tensor
        self.chunk_tokens = logits_chunk_tokens or chunk_tokens_for(columns)
        self.output: DeferredOutputLayer | None = None  # set by _build on the last pipeline stage
        self.steps_done = 0
        self.trainable = trainable
        self.models = self._build(model_path)
        self.replay = self._routing_replay()
        self.optimizer = None
        if trainable:
            self.chunks = self._wrap_for_training()
            self._install_overlap_hooks()
            self.optimizer = self._build_optimizer()
        else:  # a reference model: weights only, no gradient buffers or optimizer state
            self.chunks = self.models
            for model in self.models:
                model.requires_grad_(False)

    def _build(self, model_path: str) -> list:
        """This rank's GPTModel chunks (one, or ``virtual`` interleaved ones) with the checkpoint's weights."""
        models = []
        for vp_stage in range(self.parallel.chunks_per_rank):
            # only this chunk's share of the checkpoint is read and converted
            full = mm.full_megatron_state(
                mm.read_hf_weights(model_path, mm.chunk_needs(self.shape, vp_stage)), self.shape, self.parallel.tensor
            )
            model = mm.build_gpt_model(
                self.hf_config, self.config, self.layout.transformer_impl, vp_stage if self.parallel.virtual else None
            )
            # as Megatron's get_model + Float16Module: every parameter on this rank's device, in the
            # training dtype (the torch-norm fallback of the local spec is built on the CPU in fp32)
            model.to(device=self.device, dtype=self.config.params_dtype)
            mm.load_local_weights(model, mm.local_weights(full, self.shape, self.parallel.tensor, vp_stage))
            if getattr(model, "output_layer", None) is not None:  # the last stage's last chunk
                self.output = DeferredOutputLayer(model.output_layer)
            models.append(model)
        return models

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
            self.shape.moe_topk,
            self.layout.sequence_parallel,
            recompute=self.layout.recompute_granularity == "full",
        )

    def _wrap_for_training(self) -> list:
        """Each chunk in Megatron's DDP (gradient buffers; as Megatron's training loop, only the
        first chunk's gradient reduction is bucketed)."""
        from megatron.core.distributed import DistributedDataParallel

        ddp_config = mm.ddp_config(self.layout)
        return [
            DistributedDataParallel(self.config, ddp_config, model, disable_bucketing=vp_stage > 0)
            for vp_stage, model in enumerate(self.models)
        ]

    def _install_overlap_hooks(self) -> None:
        """The schedule's hooks for overlapped gradient reduction (as Megatron's training loop): no
        reduction before the last micro-batch, then each chunk's reduction started as soon as its
        backward ends. Overlapped parameter gathers need none: DDP's forward pre-hooks run them."""
        if not self.layout.overlap_grad_reduce:
            return

        def per_chunk(method: str):
            methods = [getattr(chunk, method) for chunk in self.chunks]
            return methods[0] if len(methods) == 1 else methods

        self.config.no_sync_func = per_chunk("no_sync")
        self.config.grad_sync_func = per_chunk("start_grad_sync")

    def gather_params(self) -> None:
        """With overlapped parameter gathers, the other ranks' shards of an update arrive in the next
        forward; readers of the weights outside a forward (export, checkpoint) gather them now."""
        if self.trainable and self.layout.overlap_param_gather:
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.optim_cfg
        config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            adam_eps=cfg.eps,
            clip_grad=cfg.clip_grad,
            use_distributed_optimizer=self.layout.use_distributed_optimizer,
            params_dtype=self.config.params_dtype,
            bf16=self.config.bf16,
            fp16=self.config.fp16,
        )
        # config_overrides={}: weight decay on every parameter, as torch.optim.AdamW in the torch worker
        return get_megatron_optimizer(config, self.chunks, config_overrides={})

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

    def _response_stats(
        self, micro: dict[str, torch.Tensor], hidden: torch.Tensor, temperature: float, entropy_grad: bool = True
    ):
        """Log-probs and entropy of the response tokens (``hidden``: the model's output, [b, s, h])."""
        if PACKED_IDS in micro:
            return self._packed_response_stats(micro, hidden, temperature, entropy_grad)
        width, length = prompt_width(micro), micro["responses"].shape[1]
        return self._stats(hidden[:, width - 1 : width - 1 + length], micro["responses"], temperature, entropy_grad)

    def _packed_response_stats(
        self, micro: dict[str, torch.Tensor], hidden: torch.Tensor, temperature: float, entropy_grad: bool
    ):
        """The same from a pack, put back in [rows, response] form. With context parallelism each
        rank scores the response tokens it holds and the rows are summed over the CP group
        (backward: each rank's share of the gradient reaches its own tokens only)."""
        positions, labels, real = response_positions(micro)
        if "cp_local" not in micro:
            return tuple(
                scatter_rows(values, real)
                for values in self._stats(hidden[0, positions], labels, temperature, entropy_grad)
            )
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        local = micro["cp_local"][positions]
        held = local >= 0
        stats = self._stats(hidden[0, local[held]], labels[held], temperature, entropy_grad)
        group = parallel_state.get_context_parallel_group()
        return tuple(
            reduce_from_tensor_model_parallel_region(
                scatter_rows(values.new_zeros(held.shape).masked_scatter(held, values), real), group
            )
            for values in stats
        )

    def _set_mode(self, train: bool) -> None:
        for chunk in self.chunks:
            chunk.train(train)

    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Token-budget micro-batches (packed ones with ``sequence_packing``); with interleaved stages,
        a multiple of PP of them, all of one shape (Megatron's interleaved schedule runs them in
        groups of PP and sends fixed shapes)."""
        if self.layout.sequence_packing:
            return self._packs(batch)
        if self.parallel.virtual:
            return uniform_micro_batches(batch, self.max_token_len, self.parallel.pipeline)
        return micro_batches(batch, self.max_token_len)

    def _packs(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Packed micro-batches. With context parallelism every row's segment is a multiple of 2 x CP
        (each rank takes two chunks of it) and the pack one of CP x the width multiple; each pack
        says which of its tokens this rank holds."""
        cp = self.parallel.context
        segment, multiple = (
            (1, self.width_multiple) if cp == 1 else (2 * cp, math.lcm(2 * cp, cp * self.width_multiple))
        )
        if self.parallel.virtual:
            packs = uniform_packs(batch, self.max_token_len, multiple, self.parallel.pipeline, segment)
        else:
            packs = packed_micro_batches(batch, self.max_token_len, multiple, segment)
        if cp == 1:
            return packs
        from megatron.core import parallel_state

        rank = parallel_state.get_context_parallel_rank()
        return [context_parallel_share(pack, cp, rank) for pack in packs]

    @property
    def width_multiple(self) -> int:
        """Widths are padded to a multiple of TP with sequence parallelism (it splits the columns over
        TP) and of 16 with FP8 (TransformerEngine's FP8 GEMMs need token counts divisible by 16)."""
        return math.lcm(self.parallel.tensor if self.layout.sequence_parallel else 1, 16 if self.layout.fp8 else 1)

    def model_shape(self, micro: dict[str, torch.Tensor]) -> tuple[int, int]:
        """(rows, width) of this micro-batch's model inputs: one row for a pack, else the width
        :func:`pad_width` gives."""
        if "cp_index" in micro:
            return 1, len(micro["cp_index"])
        if PACKED_IDS in micro:
            rows, width = micro[PACKED_IDS].shape
            return rows, width
        return micro["input_ids"].shape[0], -(-micro["input_ids"].shape[1] // self.width_multiple) * self.width_multiple

    def _model_inputs(self, micro: dict[str, torch.Tensor]) -> dict:
        """GPTModel's inputs: padded rows with the mask this layer spec takes, or one pack in THD
        form, whose row boundaries keep each row's attention (and RoPE positions) to itself."""
        if PACKED_IDS not in micro:
            tokens, positions, mask = pad_width(micro, self.width_multiple)
            te = self.layout.transformer_impl == "transformer_engine"
            return {
                "input_ids": tokens,
                "position_ids": positions,
                "attention_mask": padding_mask(mask) if te else attention_mask_4d(mask),
            }
        from megatron.core.packed_seq_params import PackedSeqParams

        # read once per micro-batch on the host: the local spec's attention and Megatron's unfused
        # RoPE split by these boundaries in every layer (a device copy would sync there each time);
        # TransformerEngine's kernels take them on the device
        bounds = micro["cu_seqlens"].cpu()
        longest = int((bounds[1:] - bounds[:-1]).max())
        te = self.layout.transformer_impl == "transformer_engine"
        cu_seqlens = micro["cu_seqlens"] if te else bounds
        tokens, positions = micro[PACKED_IDS], micro["packed_positions"]
        if "cp_index" in micro:  # this rank's share of the pack; the boundaries stay those of the whole pack
            tokens, positions = tokens[:, micro["cp_index"]], positions[:, micro["cp_index"]]
        return {
            "input_ids": tokens,
            "position_ids": positions,
            "attention_mask": None,
            "packed_seq_params": PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_kv=cu_seqlens,
                max_seqlen_q=longest,
                max_seqlen_kv=longest,
            ),
        }

    def _run_schedule(self, micros: list[dict[str, torch.Tensor]], loss_fn, forward_only: bool) -> None:
        """Megatron's forward(-backward) schedule (pipelined when PP > 1) over the micro-batches."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            source = next(data_iterator)
            micro = {k: v.to(self.device, non_blocking=True) for k, v in source.items()}
            chunk = next(i for i, c in enumerate(self.chunks) if c is model)
            if self.replay is not None:
                self.replay.before_forward(chunk, micro, self.width_multiple)
            output = model(**self._model_inputs(micro))
            if self.replay is not None:
                self.replay.after_forward(chunk, micro, self.width_multiple, key=id(source))
            return output, functools.partial(loss_fn, micro)

        shapes = [self.model_shape(micro) for micro in micros]
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
            # uniform micro-batches end with filler rows, which are not among ROWS
            stats.add(micro[ROWS], *self._response_stats(micro, hidden, temperature))
            return hidden.new_zeros(()), torch.tensor(0, dtype=torch.int), {}

        self._run_schedule(micros, collect, forward_only=True)
        mask = batch["response_mask"].float()
        return {key: value * mask for key, value in self._placed_on_every_stage(stats, batch).items()}

    def _placed_on_every_stage(self, stats: RowStats, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``stats`` in ``batch``'s row order, on every pipeline stage (collective)."""
        return {key: self._from_last_stage(value) for key, value in stats.placed(batch["responses"].shape).items()}

    def _recorded_routing(self, batch: dict[str, torch.Tensor], micros: list) -> torch.Tensor:
        """What the recording pass picked, as the batch's [B, P + R, L, K] ``routed_experts``."""
        from nemo_dapo.policy.megatron.router_replay import reduce_recorded

        assert self.replay is not None
        tokens = batch["input_ids"].shape
        shape = (*tokens, self.shape.num_layers, self.shape.moe_topk)
        parts = [(micro, self.replay.recorded[id(micro)]) for micro in micros if micro[ROWS].numel()]
        routing = place_micro_routing(shape, prompt_width(batch), parts, torch.int32)
        return reduce_recorded(routing.to(self.device)).cpu().to(routing_dtype(self.shape.num_experts))

    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Only the last pipeline stage sees logits: broadcast its result to the other stages."""
        from megatron.core import parallel_state

        if self.parallel.pipeline == 1:
            return tensor
        group = parallel_state.get_pipeline_model_parallel_group()
        on_device = tensor.to(self.device)  # NCCL broadcasts device tensors only
        dist.broadcast(on_device, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
        return on_device.cpu()

    # ---- update ----------------------------------------------------------------------------

    def update(
        self, mini_batches: list[MiniBatch], settings: LossSettings, correction: CorrectionSettings | None = None
    ) -> UpdateResult:
        require_trainable(self.trainable, "update")
        self._set_mode(train=True)
        metrics: dict[str, list[float]] = {}
        first_forward = None
        for mini in mini_batches:
            forward = RowStats() if mini.old_from_forward else None
            step_metrics = self._train_step(mini, settings, correction, forward)
            for key, values in step_metrics.items():
                metrics.setdefault(key, []).append(mn.combine_parts(key, values))
            if forward is not None:
                first_forward = within_responses(self._placed_on_every_stage(forward, mini.data), mini.data)
        return UpdateResult(metrics, first_forward)

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
            if forward is not None:
                micro["old_log_probs"] = log_probs.detach()
                forward.add(micro[ROWS], log_probs, entropy)
            loss, micro_metrics = actor_loss(
                log_probs, entropy, micro, settings, mini.global_token_count, mini.global_seq_count, correction
            )
            for key, value in micro_metrics.items():
                step_metrics.setdefault(key, []).append(value)
            return loss, micro["response_mask"].sum().int(), {}

        micros = self._micro_batches(mini.data)
        routed = sum(rows * width for rows, width in map(self.model_shape, micros))
        if self.replay is not None:
            from nemo_dapo.policy.megatron.router_replay import actions

            self.replay.start(actions().REPLAY_FORWARD)
        with per_routed_token(self.config, routed, self.device):
            self._run_schedule(micros, loss_fn, forward_only=False)
        for group in self.optimizer.param_groups:
            group["lr"] = self.optim_cfg.lr * self.lr_factor(self.steps_done)
        finite = self._gradients_finite()
        grad_norm = self.optimizer.step()[1] if finite else float("nan")  # skipped: nothing changes
        self.steps_done += 1
        step_metrics = {**self._share_metrics(step_metrics), **load_balancing_metric(self.config, len(micros))}
        if self.replay is not None:
            agreement = self.replay.agreement()
            step_metrics[mn.ROUTER_AGREEMENT["mean"].name] = [agreement["mean"]]
            step_metrics[mn.ROUTER_AGREEMENT["min"].name] = [agreement["min"]]
        step_metrics[mn.GRAD_NORM.name] = [float(grad_norm)]
        step_metrics[mn.SKIPPED_STEPS.name] = [0.0 if finite else 1.0]
        step_metrics[mn.LR.name] = [self.optim_cfg.lr * self.lr_factor(self.steps_done)]
        return step_metrics

    def _gradients_finite(self) -> bool:
        """Whether every rank's reduced gradients are finite, agreed by all ranks (one flag reduced
        over the world): in bf16 and fp32 no loss scaler skips an Inf/NaN step, so this does, as
        the torch worker does."""
        bad = torch.zeros(1, device=self.device)
        for chunk in self.chunks:
            grads = (getattr(p, "main_grad", p.grad) for p in chunk.parameters() if p.requires_grad)
            if any(g is not None and not torch.isfinite(g).all() for g in grads):
                bad.fill_(1.0)
                break
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad.item() == 0

    def _share_metrics(self, step_metrics: dict[str, list[float]]) -> dict[str, list[float]]:
        """Loss metrics exist on the last pipeline stage only; give every stage the same values."""
        from megatron.core import parallel_state

        if self.parallel.pipeline == 1:
            return step_metrics
        shared = [step_metrics]
        dist.broadcast_object_list(
            shared,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return shared[0]

    # ---- weights and checkpoints -----------------------------------------------------------

    def data_parallel_layout(self) -> tuple[int, int]:
        """(dp_rank, dp_size): the TP x PP x CP ranks of one replica must get the same rows."""
        return self.dp_rank, self.dp_size

    def export_weights(self, bucket_bytes: int = 512 << 20) -> Iterator[Bucket]:
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

    def load(self, path: str) -> None:
        from nemo_dapo.policy.megatron.checkpoint import load_checkpoint

        require_trainable(self.trainable, "load")
        load_checkpoint(self, path)

    def rng_state(self) -> dict:
        return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
