"""Turn the engines' generations into a RolloutBatch (one row per sample, groups by ``uid``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nemo_dapo.algo.batch import RolloutBatch
from nemo_dapo.policy.routing import PROMPT_ROUTING, RESPONSE_ROUTING, routing_dtype
from nemo_dapo.rollout.base import Generation


def _pad_rows(rows: Sequence[Sequence], width: int, value, dtype, left: bool = False) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            values = torch.as_tensor(list(row), dtype=dtype)
            if left:
                out[i, width - len(row) :] = values
            else:
                out[i, : len(row)] = values
    return out


def _routing_halves(
    rows_prompt: list, rows_response: list, generations: Sequence[Generation], prompt_width: int, response_width: int
) -> dict[str, torch.Tensor]:
    """The engine's routing (r3) as the batch's ``prompt_routing`` / ``response_routing``
    (:mod:`nemo_dapo.policy.routing`); positions the engine never ran stay 0 (placeholders)."""
    samples = [torch.as_tensor(r) for g in generations for r in g.routed_experts]
    layers, topk = samples[0].shape[1:]
    dtype = routing_dtype(int(max(s.max() for s in samples if s.numel())) + 1)
    prompt = torch.zeros(len(samples), prompt_width, layers, topk, dtype=dtype)
    response = torch.zeros(len(samples), response_width, layers, topk, dtype=dtype)
    for i, (routing, p, r) in enumerate(zip(samples, rows_prompt, rows_response)):
        prompt[i, prompt_width - len(p) :] = routing[: len(p)].to(dtype)
        ran = routing[len(p) : len(p) + len(r)]
        response[i, : len(ran)] = ran.to(dtype)
    return {PROMPT_ROUTING: prompt, RESPONSE_ROUTING: response}


def build_rollout_batch(
    prompt_ids: Sequence[Sequence[int]],
    generations: Sequence[Generation],
    fields: dict[str, list],
    uid_prefix: str,
    pad_token_id: int,
    policy_version: int | Sequence[int],
) -> RolloutBatch:
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
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "loss_mask": response_mask.clone(),  # narrowed by the filters (RolloutBatch.narrow_loss_mask)
        "rollout_log_probs": _pad_rows(rows_logprob, response_width, 0.0, torch.float32),
        "policy_version": torch.tensor([versions[p] for p in source], dtype=torch.long),
        "aborted": torch.tensor([reason == "abort" for reason in finish]),
    }
    if generations and generations[0].token_versions:  # streaming: the version that drew each token
        drawn_by = [versions for g in generations for versions in g.token_versions]
        tensors["token_versions"] = _pad_rows(drawn_by, response_width, 0, torch.long)
    if generations and generations[0].routed_experts:
        tensors.update(_routing_halves(rows_prompt, rows_response, generations, prompt_width, response_width))
    repeated = {name: [values[p] for p in source] for name, values in fields.items()}
    return RolloutBatch(tensors, {"uid": uids, "finish_reason": finish, **repeated})


# What a batch row keeps of its dataset item besides the prompt's tokens: batch field -> item key
ITEM_FIELDS = {"ground_truth": "ground_truth", "data_source": "data_source", "prompt_index": "index"}


def batch_from_items(
    items: Sequence[dict],
    generations: Sequence[Generation],
    uid_prefix: str,
    pad_token_id: int,
    policy_version: int | Sequence[int],
) -> RolloutBatch:
    """Dataset items (``RLDataset`` rows: ``prompt_ids``, ``ground_truth``, ``data_source``,
    ``index``) and the engines' generations for them, as a RolloutBatch: the one way training,
    validation and evaluation build their batches."""
    fields = {name: [item[key] for item in items] for name, key in ITEM_FIELDS.items()}
    prompts = [item["prompt_ids"] for item in items]
    return build_rollout_batch(prompts, generations, fields, uid_prefix, pad_token_id, policy_version)
