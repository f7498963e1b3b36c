"""Prompt datasets in the verl format, batching, and a resumable sampler."""

from nemo_dapo.data.collate import collate_prompts
from nemo_dapo.data.dataset import TRUNCATION_MODES, RLDataset, encode_prompts, render_prompt, truncate_prompt
from nemo_dapo.data.records import DatasetError, PromptRecord, read_records, validate_row
from nemo_dapo.data.sampler import ResumableBatchSampler

__all__ = [
    "TRUNCATION_MODES",
    "DatasetError",
    "PromptRecord",
    "RLDataset",
    "ResumableBatchSampler",
    "collate_prompts",
    "encode_prompts",
    "read_records",
    "render_prompt",
    "truncate_prompt",
    "validate_row",
]
