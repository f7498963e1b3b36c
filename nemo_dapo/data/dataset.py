"""The RL prompt dataset: validated rows, chat-templated and tokenized once up front.

Tokenizing everything at construction lets over-long prompts be filtered (and
counted) before training starts, and makes ``__getitem__`` a cheap lookup. Repeated
problems are found first, so that each is tokenized once, however many rows repeat it.
"""

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_dapo.data.collate import collate_prompts
from nemo_dapo.data.duplicates import find_duplicates, report_duplicates
from nemo_dapo.data.records import DatasetError, PromptRecord, read_records

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("left", "right", "error")


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """Apply the tokenizer's chat template and open the assistant turn, as text."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):  # guards against API drift: transformers 5 returns dicts when tokenizing
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def encode_prompts(tokenizer: Any, records: Sequence[PromptRecord]) -> list[list[int]]:
    """Token ids of each templated prompt.

    The chat template already writes the special tokens, so the encoder must
    not add its own (a BOS or EOS would otherwise appear twice).
    """
    texts = [render_prompt(tokenizer, record.messages) for record in records]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def truncate_prompt(prompt_ids: list[int], max_length: int, mode: str, location: str) -> list[int]:
    """Cut a prompt to ``max_length`` tokens.

    ``left`` keeps the end, which holds the question and the generation prompt;
    ``right`` keeps the start; ``error`` refuses.
    """
    if len(prompt_ids) <= max_length:
        return prompt_ids
    if mode == "left":
        return prompt_ids[-max_length:]
    if mode == "right":
        return prompt_ids[:max_length]
    raise DatasetError(
        f"{location}: the templated prompt has {len(prompt_ids)} tokens, more than max_prompt_length={max_length}; "
        "use truncation='left'/'right' or filter_overlong_prompts=True"
    )


class RLDataset:
    """Prompts for RL rollouts, indexable and sized like a torch map-style dataset.

    ``index`` in each item is the row's position in the concatenated files
    (before filtering), so it identifies the row across runs. ``extra_info.index``
    is not used for this: in the verl evaluation files it is repeated across
    the copies of a problem.

    Each distinct problem (:mod:`nemo_dapo.data.duplicates`) is templated and
    tokenized once, its copies sharing the ids: DAPO-Math-17k repeats ~17.9k
    problems in 1.79M rows. ``drop_duplicates`` keeps the first row of each
    problem only; ``duplicates`` tells what repeats in the files either way.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_prompt_length: int = 1024,
        truncation: str = "left",
        filter_overlong_prompts: bool = False,
        drop_duplicates: bool = False,
    ):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r}; expected one of {TRUNCATION_MODES}")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={max_prompt_length}; expected a positive number of tokens")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        records = read_records(files)
        self.duplicates = find_duplicates(records)
        report_duplicates(self.duplicates, files, dropped=drop_duplicates)
        first_rows, first_row_of = self.duplicates.first_rows, self.duplicates.first_row_of
        encoded = dict(zip(first_rows, encode_prompts(tokenizer, [records[row] for row in first_rows])))
        row_ids = list(first_rows) if drop_duplicates else list(range(len(records)))
        if filter_overlong_prompts:
            row_ids = self._drop_overlong(row_ids, [len(encoded[first_row_of[row]]) for row in row_ids], files)
        fitted = {  # kept problems in file order: truncation='error' names the first row too long
            first: truncate_prompt(encoded[first], max_prompt_length, truncation, records[first].location)
            for first in dict.fromkeys(first_row_of[row] for row in row_ids)
        }
        self._records = [records[row] for row in row_ids]
        self._row_ids = row_ids
        self._positions: dict[int, int] | None = None  # row id -> position, built when first asked
        self._prompt_ids = [fitted[first_row_of[row]] for row in row_ids]  # copies share one list

    def _drop_overlong(self, row_ids: list[int], lengths: list[int], files: object) -> list[int]:
        """Keep rows whose prompt (``lengths``: tokens of each) fits; log the count so silent data
        loss cannot happen."""
        kept = [row for row, length in zip(row_ids, lengths) if length <= self.max_prompt_length]
        logger.log(
            logging.INFO if len(kept) < len(row_ids) else logging.DEBUG,
            "Dropped %d of %d prompts longer than max_prompt_length=%d tokens from %s",
            len(row_ids) - len(kept),
            len(row_ids),
            self.max_prompt_length,
            files,
        )
        if not kept:
            raise DatasetError(f"{files}: every prompt is longer than max_prompt_length={self.max_prompt_length}")
        return kept

    def __len__(self) -> int:
        return len(self._records)

    def row_id(self, position: int) -> int:
        """The ``index`` of the item at ``position``: its row in the files, before filtering."""
        return self._row_ids[position]

    def position_of(self, row_id: int) -> int:
        """Where the row ``row_id`` of the files is in this dataset; raises :class:`DatasetError`
        for a row it does not hold (filtered out, or past the end of the files)."""
        if self._positions is None:
            self._positions = {row: position for position, row in enumerate(self._row_ids)}
        if row_id not in self._positions:
            raise DatasetError(
                f"row {row_id} of the data files is not in this dataset ({len(self)} prompts): the files, "
                "data.max_prompt_length or data.drop_duplicate_prompts changed since it was drawn"
            )
        return self._positions[row_id]

    def __getitem__(self, position: int) -> dict[str, Any]:
        """Copies of the stored fields, so callers may mutate what they get."""
        record = self._records[position]
        return {
            "prompt_ids": list(self._prompt_ids[position]),
            "raw_prompt": [dict(message) for message in record.messages],
            "ground_truth": record.ground_truth,
            "data_source": record.data_source,
            "extra_info": dict(record.extra_info),
            "index": self._row_ids[position],
        }

    def collate(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """``collate_fn`` for a DataLoader: left-padded batch using this tokenizer's pad id."""
        return collate_prompts(items, self.tokenizer.pad_token_id)
