"""Turning dataset items into a padded prompt batch."""

from collections.abc import Sequence
from typing import Any

import torch

# Item fields passed through as plain per-sample lists (prompt_ids too: rollout engines want them unpadded).
LIST_FIELDS = ("prompt_ids", "raw_prompt", "ground_truth", "data_source", "extra_info", "index")


def collate_prompts(items: Sequence[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Left-pad prompts so every sequence ends at the same column, where generation starts.

    Returns ``input_ids`` and ``attention_mask`` as int64 tensors of shape
    ``[batch, longest prompt]`` plus one list per field in ``LIST_FIELDS``.
    """
    if not items:
        raise ValueError("cannot collate an empty batch")
    if pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set one before collating prompts")
    longest = max(len(item["prompt_ids"]) for item in items)
    input_ids = torch.full((len(items), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), longest), dtype=torch.long)
    for row, item in enumerate(items):
        start = longest - len(item["prompt_ids"])
        input_ids[row, start:] = torch.tensor(item["prompt_ids"], dtype=torch.long)
        attention_mask[row, start:] = 1
    batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    for field in LIST_FIELDS:
        batch[field] = [item[field] for item in items]
    return batch
