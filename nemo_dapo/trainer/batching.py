"""Turn generations into a RolloutBatch, and a RolloutBatch into per-rank worker batches."""

from __future__ import annotations

from typing import Sequence

import torch

from nemo_dapo.algo.batch import RolloutBatch, group_rows
from nemo_dapo.policy.base import MiniBatch
from nemo_dapo.rollout.base import Generation

# Response-aligned [B, R] fields a policy worker may need for its loss.
WORKER_FIELDS = ("responses", "advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs", "is_weights")


def _pad_rows(rows: Sequence[Sequence], width: int, value, dtype, left: bool = False) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            values = torch.as_tensor(list(row), dtype=dtype)
            if left:
                out[i, width - len(row):] = values
            else:
                out[i, : len(row)] = values
    return out


def build_rollout_batch(prompt_ids: Sequence[Sequence[int]], generations: Sequence[Generation], fields: dict[str, list],
                        uid_prefix: str, pad_token_id: int, policy_version: int | Sequence[int]) -> RolloutBatch:
    """One row per sample; prompt-level ``fields`` (ground truth, data source...) are repeated n times.

    Rows of one prompt share ``uid`` ``<uid_prefix>:<prompt position>``, the group id GRPO and
    dynamic sampling work on. ``policy_version``: the weights that generated each prompt's
    samples (one number for all, or one per prompt).
    """
    versions = [policy_version] * len(prompt_ids) if isinstance(policy_version, int) else list(policy_version)
    rows_prompt, rows_response, rows_logprob, uids, finish, source = [], [], [], [], [], []
    for position, (prompt, generation) in enumerate(zip(prompt_ids, generations)):
        for tokens, log_probs, reason in zip(generation.token_ids, generation.log_probs, generation.finish_reasons):
            rows_prompt.append(prompt)
            rows_response.append(tokens)
            rows_logprob.append(log_probs)
            uids.append(f"{uid_prefix}:{position}")
            finish.append(reason)
            source.append(position)
    prompt_width = max(len(p) for p in rows_prompt)
    response_width = max(max((len(r) for r in rows_response), default=1), 1)
    prompts = _pad_rows(rows_prompt, prompt_width, pad_token_id, torch.long, left=True)
    prompt_mask = _pad_rows([[1] * len(p) for p in rows_prompt], prompt_width, 0, torch.long, left=True)
    responses = _pad_rows(rows_response, response_width, pad_token_id, torch.long)
    response_mask = _pad_rows([[1] * len(r) for r in rows_response], response_width, 0, torch.long)
    tensors = {
        "prompts": prompts, "prompt_mask": prompt_mask, "responses": responses, "response_mask": response_mask,
        "rollout_log_probs": _pad_rows(rows_logprob, response_width, 0.0, torch.float32),
        "policy_version": torch.tensor([versions[p] for p in source], dtype=torch.long),
        "aborted": torch.tensor([reason == "abort" for reason in finish]),
    }
    repeated = {name: [values[p] for p in source] for name, values in fields.items()}
    return RolloutBatch(tensors, {"uid": uids, "finish_reason": finish, **repeated})


def loss_mask(batch: RolloutBatch) -> torch.Tensor:
    """The tokens the loss sees: ``loss_mask`` once a filter set one (overlong filtering, rejection
    sampling), else every response token."""
    return batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]


def worker_inputs(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """The tensors a policy worker reads: full sequences plus response-aligned fields.

    ``response_mask`` sent to the worker is the loss mask (after the filters, if any);
    ``attention_mask`` keeps every generated token so the forward pass sees the real context.
    """
    attention = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    data = {
        "input_ids": torch.cat([batch["prompts"], batch["responses"]], dim=1),
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": loss_mask(batch),
    }
    data.update({name: batch[name] for name in WORKER_FIELDS if name in batch})
    return data


def shard(data: dict[str, torch.Tensor], world_size: int) -> list[dict[str, torch.Tensor]]:
    """Contiguous, near-equal row shards, one per data-parallel rank."""
    rows = next(iter(data.values())).shape[0]
    bounds = [rows * r // world_size for r in range(world_size + 1)]
    return [{k: v[bounds[r]: bounds[r + 1]] for k, v in data.items()} for r in range(world_size)]


def mini_batches_per_rank(batch: RolloutBatch, prompts_per_mini_batch: int, world_size: int,
                          ppo_epochs: int) -> list[list[MiniBatch]]:
    """Each mini-batch = whole prompt groups; counts are mini-batch-wide so any split is exact."""
    data = worker_inputs(batch)
    groups = list(group_rows(batch["uid"]).values())
    per_rank: list[list[MiniBatch]] = [[] for _ in range(world_size)]
    for start in range(0, len(groups), prompts_per_mini_batch):
        rows = torch.tensor([r for g in groups[start: start + prompts_per_mini_batch] for r in g])
        part = {k: v[rows] for k, v in data.items()}
        mask = part["response_mask"]
        tokens, seqs = float(mask.sum()), float((mask.sum(dim=1) > 0).sum())
        for rank, rank_part in enumerate(shard(part, world_size)):
            per_rank[rank].append(MiniBatch(rank_part, tokens, seqs))
    return [mbs * ppo_epochs for mbs in per_rank]
