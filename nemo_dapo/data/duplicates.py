"""Rows that repeat a problem: counted when data loads, and dropped where the caller asks.

Public RL files repeat problems: verl's AIME 2024 file holds each of its 30 problems 32 times
(one sample per row then gives avg@32), and DAPO-Math-17k holds about 17.9k problems about 100
times each (1.79M rows). Two rows are the same problem when their ``data_source``, prompt
messages and ground truth are all equal; ``extra_info`` is not compared (verl's copies differ
there). The same prompt with two different ground truths stays two problems, with a warning:
one answer is probably wrong, and only the file can be fixed to say which.

Finding them costs a few dict lookups per row on the validated records, before any tokenizing:
copies template and tokenize to the same ids, so a dataset tokenizes each problem once and its
copies share the result, whether they are kept or dropped.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from nemo_dapo.data.records import PromptRecord

logger = logging.getLogger(__name__)

PromptKey = tuple[str, tuple[tuple[str, str], ...]]  # data source, (role, content) of each message


def prompt_key(record: PromptRecord) -> PromptKey:
    """What makes two rows ask the same question: the data source and every message."""
    return record.data_source, tuple((message["role"], message["content"]) for message in record.messages)


@dataclass(frozen=True)
class Duplicates:
    """How the rows of a dataset map onto distinct problems (prompt and ground truth)."""

    first_row_of: list[int]  # for each row, the first row of its problem (itself if none before)
    first_rows: list[int]  # the first row of each distinct problem, in file order
    most_copies: int  # rows of the most repeated problem (1: no duplicates)
    answer_conflicts: list[tuple[str, str]]  # (first row, row with another ground truth) locations

    @property
    def rows(self) -> int:
        return len(self.first_row_of)

    @property
    def distinct(self) -> int:
        return len(self.first_rows)


def find_duplicates(records: Sequence[PromptRecord]) -> Duplicates:
    """Each row's problem, named by its first row, and the copies of each, in one pass over ``records``."""
    first_row_of_problem: dict[tuple[PromptKey, str], int] = {}
    first_with_prompt: dict[PromptKey, PromptRecord] = {}
    copies: dict[int, int] = {}  # first row -> rows of its problem
    first_row_of: list[int] = []
    conflicts: list[tuple[str, str]] = []
    for row, record in enumerate(records):
        prompt = prompt_key(record)
        first = first_row_of_problem.setdefault((prompt, record.ground_truth), row)
        first_row_of.append(first)
        copies[first] = copies.get(first, 0) + 1
        if first == row:
            earlier = first_with_prompt.setdefault(prompt, record)
            if earlier is not record:
                conflicts.append((earlier.location, record.location))
    return Duplicates(first_row_of, list(copies), max(copies.values(), default=0), conflicts)


def report_duplicates(duplicates: Duplicates, files: object, dropped: bool) -> None:
    """Log what repeats in ``files`` (nothing when every row is its own problem), and warn about
    prompts given more than one answer."""
    if duplicates.most_copies > 1:
        logger.info(
            "%s: %d rows hold %d distinct problems (data_source, prompt and ground truth), one of them %d times; %s",
            files,
            duplicates.rows,
            duplicates.distinct,
            duplicates.most_copies,
            "the first row of each problem kept, its copies dropped" if dropped else "every row kept",
        )
    if duplicates.answer_conflicts:
        first, other = duplicates.answer_conflicts[0]
        logger.warning(
            "%s: %d prompts appear with more than one ground truth (the first: %s and %s); each answer is kept "
            "as a problem of its own: fix the file if one of them is wrong",
            files,
            len(duplicates.answer_conflicts),
            first,
            other,
        )


def warn_if_copies_outnumber_samples(duplicates: Duplicates, samples: int, setting: str) -> None:
    """A file that repeats each problem k times for avg@k at one sample per row (verl's AIME files)
    loses samples once folded, unless each problem is sampled k times: say so, naming ``setting``."""
    if duplicates.most_copies > samples:
        logger.warning(
            "the evaluation data held a problem %d times; its %d distinct problems are sampled %s=%d times "
            "each: set %s=%d for the estimate the copies gave (mean@%d)",
            duplicates.most_copies,
            duplicates.distinct,
            setting,
            samples,
            setting,
            duplicates.most_copies,
            duplicates.most_copies,
        )
