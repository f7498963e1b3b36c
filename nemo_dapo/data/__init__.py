"""Prompt datasets in the verl format, their repeated problems, batching, and a resumable sampler."""

from nemo_dapo.data.collate import collate_prompts
from nemo_dapo.data.dataset import TRUNCATION_MODES, RLDataset, encode_prompts, render_prompt, truncate_prompt
from nemo_dapo.data.duplicates import Duplicates, find_duplicates
from nemo_dapo.data.records import DatasetError, PromptRecord, read_records, validate_row
from nemo_dapo.data.sampler import ResumableBatchSampler

__all__ = [
    "TRUNCATION_MODES",
    "DatasetError",
    "Duplicates",
    "PromptRecord",
    "RLDataset",
    "ResumableBatchSampler",
    "collate_prompts",
    "encode_prompts",
    "find_duplicates",
    "read_records",
    "render_prompt",
    "truncate_prompt",
    "validate_row",
]
