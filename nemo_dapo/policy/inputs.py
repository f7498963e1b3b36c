"""What a policy worker is fed: a RolloutBatch cut into per-rank tensors and mini-batches.

The driver-side groups (``cluster/groups.py``) call these; the workers read the fields named
here. Mini-batches are whole prompt groups whose token and sequence counts are the
mini-batch's, so any split over ranks and micro-batches gives the same loss.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from nemo_dapo.algo.batch import RolloutBatch, group_rows
from nemo_dapo.policy.base import MiniBatch
from nemo_dapo.policy.microbatch import ROUTED_EXPERTS
from nemo_dapo.policy.rank_rows import RankRows
from nemo_dapo.policy.routing import PROMPT_ROUTING, RESPONSE_ROUTING, join_routing

# Response-aligned [B, R] fields a policy worker may need for its loss.
WORKER_FIELDS = ("responses", "advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs", "is_weights")


def worker_inputs(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """The tensors a policy worker reads: full sequences plus response-aligned fields.

    ``loss_mask`` is the tokens the loss sees (after the filters, if any); ``attention_mask`` keeps
    every generated token so the forward pass sees the real context.
    """
    attention = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    padding = attention == 0
    # padding is 0 in every field (whatever pad id each round used), so none of it travels (RankRows)
    data = {
        "input_ids": torch.cat([batch["prompts"], batch["responses"]], dim=1).masked_fill(padding, 0),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(dim=1) - 1).masked_fill(padding, 0),
        "loss_mask": batch["loss_mask"],
        **{name: batch[name] for name in WORKER_FIELDS if name in batch},
    }
    data["responses"] = data["responses"].masked_fill(batch["response_mask"] == 0, 0)
    if PROMPT_ROUTING in batch:  # MoE routing replay: the experts to replay, aligned with input_ids
        data[ROUTED_EXPERTS] = join_routing(batch[PROMPT_ROUTING], batch[RESPONSE_ROUTING])
    return data


def shard(data: dict[str, torch.Tensor], world_size: int) -> list[RankRows]:
    """Contiguous, near-equal row shards, one per data-parallel rank."""
    rows = next(iter(data.values())).shape[0]
    bounds = [rows * r // world_size for r in range(world_size + 1)]
    return [RankRows({k: v[bounds[r] : bounds[r + 1]] for k, v in data.items()}) for r in range(world_size)]


def mini_batch_rows(batch: RolloutBatch, prompts_per_mini_batch: int) -> list[torch.Tensor]:
    """The batch rows of each mini-batch: ``prompts_per_mini_batch`` whole prompt groups, in order."""
    groups = list(group_rows(batch["uid"]).values())
    return [
        torch.tensor([row for group in groups[start : start + prompts_per_mini_batch] for row in group])
        for start in range(0, len(groups), prompts_per_mini_batch)
    ]


def mini_batches_per_rank(
    batch: RolloutBatch,
    prompts_per_mini_batch: int,
    world_size: int,
    ppo_epochs: int,
    first_old_from_forward: bool = False,
) -> list[list[MiniBatch]]:
    """Each mini-batch = whole prompt groups; counts are mini-batch-wide so any split is exact.

    ``first_old_from_forward``: the first mini-batch takes its old log-probs from its own forward
    (:class:`MiniBatch`); only that first step runs on unchanged weights, so later epochs do not
    (whether it is exact at all is :func:`~nemo_dapo.trainer.old_policy.rows_scored_by_update`'s to say)."""
    data = worker_inputs(batch)
    per_rank: list[list[MiniBatch]] = [[] for _ in range(world_size)]
    for index, rows in enumerate(mini_batch_rows(batch, prompts_per_mini_batch)):
        part = {k: v[rows] for k, v in data.items()}
        mask = part["loss_mask"]
        tokens, seqs = float(mask.sum()), float((mask.sum(dim=1) > 0).sum())
        from_forward = first_old_from_forward and index == 0
        for rank, rank_part in enumerate(shard(part, world_size)):
            per_rank[rank].append(MiniBatch(rank_part, tokens, seqs, from_forward))
    return [mbs + [replace(mb, old_from_forward=False) for mb in mbs] * (ppo_epochs - 1) for mbs in per_rank]
