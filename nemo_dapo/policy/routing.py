"""MoE routing that travels with a batch: the top-k expert ids of every token in every MoE layer.

Routing replay (docs/moe.md) makes the trainer run the network the rollout sampled from: R3
replays the experts the engine picked, R2 the ones the trainer's own ``old_log_prob`` pass
picked. Either way the routing is data, moved like the log-probs:

- in a :class:`~nemo_dapo.algo.batch.RolloutBatch`: ``prompt_routing`` [B, P, L, K] (left-padded
  like ``prompts``) and ``response_routing`` [B, R, L, K]; L = MoE layers, K = experts per token;
- in a worker batch: ``routed_experts`` [B, P + R, L, K], aligned with ``input_ids`` (so the
  micro-batching, length sorting and packing that cut ``input_ids`` cut it the same way); in a
  :class:`~nemo_dapo.policy.microbatch.MicroBatch`, its ``routing``.

Ids are stored as uint8 when the model has at most 256 experts, else int16: L x K bytes per
token (Qwen3-30B-A3B: 48 layers x top-8 = 384 B), twice that past 256 experts. Positions with no
routing (padding, and the last token of a sequence, which the engine never runs) hold
placeholders; :func:`replay_targets` gives them distinct experts and :func:`scored_tokens`
leaves them out of the agreement metric. Nothing here imports a backend.
"""

from __future__ import annotations

import torch

from nemo_dapo.policy.microbatch import MicroBatch

PROMPT_ROUTING, RESPONSE_ROUTING = "prompt_routing", "response_routing"  # RolloutBatch halves


def routing_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


def routing_bytes_per_token(num_layers: int, topk: int, num_experts: int) -> int:
    """What routing replay adds to every token of a batch (docs/moe.md)."""
    return num_layers * topk * routing_dtype(num_experts).itemsize


def join_routing(prompt_routing: torch.Tensor, response_routing: torch.Tensor) -> torch.Tensor:
    """The RolloutBatch halves as one worker-batch tensor aligned with ``input_ids``."""
    return torch.cat([prompt_routing, response_routing], dim=1)


def split_routing(routed: torch.Tensor, prompt_width: int) -> dict[str, torch.Tensor]:
    """A worker-batch routing tensor back into the RolloutBatch halves."""
    return {PROMPT_ROUTING: routed[:, :prompt_width], RESPONSE_ROUTING: routed[:, prompt_width:]}


def model_token_places(micro: MicroBatch, width_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) in the micro-batch's [rows, width] tensors of every token the model runs, in
    the order a MoE router sees them (Megatron flattens [sequence, batch]: position-major), -1
    for padding. A pack lists its positions (this context-parallel rank's share of them)."""
    width = micro["input_ids"].shape[1]
    if micro.pack is not None:
        source = micro.pack.source
        if micro.pack.share is not None:
            source = source[micro.pack.share.index.to(source.device)]
        real = source >= 0
        return torch.where(real, source // width, -1), torch.where(real, source % width, -1)
    rows = micro["input_ids"].shape[0]
    padded = -(-width // width_multiple) * width_multiple
    cols = torch.arange(padded)[:, None].expand(padded, rows).reshape(-1)
    row_of = torch.arange(rows)[None, :].expand(padded, rows).reshape(-1)
    mask = micro["attention_mask"].cpu()
    real = (cols < width) & (mask[row_of, cols.clamp(max=width - 1)] > 0)
    return torch.where(real, row_of, -1), torch.where(real, cols, -1)


def last_real_columns(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last real column (its final token: nothing downstream reads its MoE output)."""
    width = attention_mask.shape[1]
    return width - 1 - torch.flip(attention_mask.cpu() > 0, dims=[1]).int().argmax(dim=1)


def scored_tokens(micro: MicroBatch, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The tokens whose routing is compared: real ones except each row's last, which the engine
    never runs (it is sampled, not fed back) and so has no routing of its own."""
    last = last_real_columns(micro["attention_mask"])
    real = rows >= 0
    return real & (cols != last[rows.clamp(min=0)])


def replay_targets(
    routing: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, layers: list[int], topk: int
) -> list[torch.Tensor]:
    """Per MoE layer in ``layers`` (0-based, over the whole model), the [tokens, K] expert ids to
    replay; padding gets experts 0..K-1 (distinct, so dispatch sends it like any token)."""
    picked = routing[rows.clamp(min=0), cols.clamp(min=0)].long()  # [tokens, L, K]
    picked[rows < 0] = torch.arange(topk)
    return [picked[:, layer].contiguous() for layer in layers]


def place_recorded(
    recorded: dict[int, torch.Tensor], rows: torch.Tensor, cols: torch.Tensor, out: torch.Tensor
) -> None:
    """Write a micro-batch's recorded ids ({layer: [tokens, K]}) into ``out`` [rows, width, L, K]
    (the micro-batch's trimmed shape); padding tokens are skipped."""
    real = rows >= 0
    for layer, ids in recorded.items():
        out[rows[real], cols[real], layer] = ids[real.to(ids.device)].to(out.dtype).cpu()


def place_micro_routing(
    batch_shape: tuple[int, ...],
    batch_prompt_width: int,
    parts: list[tuple[MicroBatch, torch.Tensor]],
    dtype: torch.dtype,
) -> torch.Tensor:
    """A [B, P + R, L, K] tensor with every micro-batch's routing ([rows, width, L, K], trimmed to
    its own prompt and response columns) put back at its rows and columns."""
    out = torch.zeros(batch_shape, dtype=dtype)
    for micro, values in parts:
        offset = batch_prompt_width - micro.prompt_width
        rows = micro.rows.cpu()
        real = min(len(rows), values.shape[0])
        out[rows[:real], offset : offset + values.shape[1]] = values[:real]
    return out
