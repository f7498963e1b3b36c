"""Routing replay on megatron-core's MoE routers (R2 / R3, docs/moe.md).

megatron-core 0.16 gives every top-k router a hook (``router.router_replay``, a
:class:`RouterReplay`) that either records the experts it picks or replays given ones; with
replay the router's scores are still computed and gathered at the replayed experts, so the
router keeps its gradient. This module installs one hook per MoE layer of this rank's model
chunks, feeds each micro-batch's ids in the order the router sees its tokens, collects what a
recording pass picked, and counts how often the router's own top-k agrees with what it replays.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_dapo.policy.microbatch import MicroBatch
from nemo_dapo.policy.routing import (
    model_token_places,
    place_recorded,
    replay_targets,
    scored_tokens,
)


def _replay_base():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


def actions():
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    return RouterReplayAction


class LayerReplay(_replay_base()):  # type: ignore[misc]
    """One MoE layer's hook; in a replayed forward it also counts, over the scored tokens, the
    share of replayed experts the router's own top-k would pick (``agreement``: sum, tokens).

    With full activation recompute a training forward runs without autograd and the layer runs
    again inside the backward, with it: that second run takes its micro-batch's ids from
    megatron-core's backward queue (in forward order, as the schedules run backwards), the way
    ``REPLAY_BACKWARD`` does; nothing else in megatron-core switches to that action.
    """

    def __init__(self, layer: int, recompute: bool = False) -> None:
        super().__init__()
        # megatron-core lists every instance for its global setters; this module drives its own
        # (a process may hold several models: policy and tests)
        _replay_base().global_router_replay_instances.remove(self)
        self.layer = layer  # 0-based over the whole model
        self.recompute = recompute
        self.scored: torch.Tensor | None = None
        self.agreement = torch.zeros(2, dtype=torch.float64)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        replaying = self.router_replay_action is actions().REPLAY_FORWARD
        recomputing = replaying and self.recompute and torch.is_grad_enabled()
        if recomputing:
            self.router_replay_action = actions().REPLAY_BACKWARD
        try:
            probs, indices = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        finally:
            if recomputing:
                self.router_replay_action = actions().REPLAY_FORWARD
        if replaying and not recomputing and self.scored is not None:
            with torch.no_grad():
                _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                hits = (own[:, :, None] == indices[:, None, :]).any(dim=-1).sum(dim=-1).double() / topk
                scored = self.scored.to(hits.device)
                self.agreement += torch.stack([hits[scored].sum(), scored.sum().double()]).cpu()
        return probs, indices


class RoutingReplay:
    """The hooks of one worker's model chunks. ``mode``: ``r2`` or ``r3`` (``actor.megatron.router_replay``)."""

    def __init__(
        self, models: list, num_layers: int, topk: int, sequence_parallel: bool, recompute: bool = False
    ) -> None:
        self.num_layers, self.topk = num_layers, topk
        self.sequence_parallel = sequence_parallel
        self.chunks: list[list[LayerReplay]] = []
        for model in models:
            hooks = []
            for layer in model.decoder.layers:
                hook = LayerReplay(layer.layer_number - 1, recompute)
                layer.mlp.router.router_replay = hook
                hooks.append(hook)
            self.chunks.append(hooks)
        self.action = None
        self.recorded: dict[int, torch.Tensor] = {}  # id(micro-batch) -> its picks, [rows, width, L, K]

    @property
    def hooks(self) -> list[LayerReplay]:
        return [hook for chunk in self.chunks for hook in chunk]

    def start(self, action) -> None:
        """Every hook records, replays (``REPLAY_FORWARD``) or stays out (None) until the next start."""
        self.action = action
        self.recorded = {}
        for hook in self.hooks:
            hook.clear_indices()
            hook.scored = None
            if action is None:
                hook.clear_router_replay_action()
            else:
                hook.set_router_replay_action(action)

    def _places(self, micro: MicroBatch, width_multiple: int):
        """This rank's tokens of ``micro`` in router order (a TP rank's sequence share under SP)."""
        rows, cols = model_token_places(micro, width_multiple)
        if self.sequence_parallel:
            from megatron.core import parallel_state

            share = len(rows) // parallel_state.get_tensor_model_parallel_world_size()
            start = parallel_state.get_tensor_model_parallel_rank() * share
            rows, cols = rows[start : start + share], cols[start : start + share]
        return rows, cols

    def before_forward(self, chunk: int, micro: MicroBatch, width_multiple: int) -> None:
        """Give the chunk's hooks this micro-batch's replay targets (and the tokens to score)."""
        if self.action is not actions().REPLAY_FORWARD:
            return
        if micro.routing is None:
            raise ValueError(
                "actor.megatron.router_replay: replay needs the batch's routed_experts (r3: returned by the "
                "engine; r2: recorded by compute_log_prob) and this batch has none"
            )
        rows, cols = self._places(micro, width_multiple)
        hooks = self.chunks[chunk]
        targets = replay_targets(micro.routing, rows.cpu(), cols.cpu(), [h.layer for h in hooks], self.topk)
        scored = scored_tokens(micro, rows.cpu(), cols.cpu())
        for hook, target in zip(hooks, targets):
            hook.set_target_indices(target.to(micro["input_ids"].device))
            hook.scored = scored

    def after_forward(self, chunk: int, micro: MicroBatch, width_multiple: int, key: int) -> None:
        """A recording pass: add the chunk's picks for micro-batch ``key`` to its [rows, width, L, K]
        tensor (interleaved stages fill their layers of it at different times)."""
        if self.action is not actions().RECORD:
            return
        rows, cols = self._places(micro, width_multiple)
        shape = (*micro["input_ids"].shape, self.num_layers, self.topk)
        out = self.recorded.setdefault(key, torch.zeros(shape, dtype=torch.int32))
        place_recorded({h.layer: h.get_recorded_indices() for h in self.chunks[chunk]}, rows.cpu(), cols.cpu(), out)

    def agreement(self) -> dict[str, float]:
        """Per MoE layer, the replayed experts' share the router's own top-k also picks, over every
        rank's scored tokens; mean and min over layers. Collective; resets the counts."""
        counts = torch.zeros(self.num_layers, 2, dtype=torch.float64)
        for hook in self.hooks:
            counts[hook.layer] += hook.agreement
            hook.agreement.zero_()
        if dist.is_initialized():
            dist.all_reduce(counts)
        per_layer = counts[:, 0] / counts[:, 1].clamp(min=1)
        return {"mean": float(per_layer.mean()), "min": float(per_layer.min())}


def reduce_recorded(routing: torch.Tensor) -> torch.Tensor:
    """Every layer's and token's recorded ids on every rank of a replica: each pipeline stage
    recorded its own layers, and under sequence or context parallelism each rank its own tokens
    (zeros elsewhere). Collective over the TP, PP and CP groups."""
    from megatron.core import parallel_state

    groups = (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_context_parallel_group(),
    )
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(routing, op=dist.ReduceOp.MAX, group=group)
    return routing
