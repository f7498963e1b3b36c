"""Reading and validating verl-format prompt datasets (parquet or jsonl).

Each row holds ``prompt`` (chat messages), ``data_source``, ``reward_model``
(with ``ground_truth``) and optionally ``extra_info`` and ``ability``. Rows are
validated when read so that a bad row fails at startup with a message naming
the file, the row and the field, instead of deep inside a training step.
This module is deliberately free of torch.
"""

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from nemo_dapo.errors import InputError

MESSAGE_ROLES = ("system", "user", "assistant")

_TYPE_NAMES = {str: "a string", list: "a list", dict: "an object (dict)"}

_PROMPT_HINT = "each row needs prompt=[{'role': str, 'content': str}, ...]"
_REWARD_HINT = "each row needs reward_model={'ground_truth': str}"


class DatasetError(InputError, ValueError):
    """A dataset file or row does not follow the expected verl format."""


@dataclass(frozen=True)
class PromptRecord:
    """One validated dataset row, plus where it came from for error messages."""

    messages: list[dict[str, str]]
    data_source: str
    ground_truth: str
    reward_style: str | None
    extra_info: dict[str, Any]
    ability: str | None
    location: str  # e.g. "aime.parquet row 7"


def read_records(paths: str | Path | Sequence[str | Path]) -> list[PromptRecord]:
    """Read and validate every row of one or several files, concatenated in the given order."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DatasetError("no dataset files given")
    records = []
    for path in paths:
        for location, row in _iter_rows(Path(path)):
            records.append(validate_row(row, location))
    return records


def check_readable(paths: Sequence[str | Path]) -> None:
    """Each file is there and reads as its format, cheaply (a parquet file's footer, a jsonl file's
    bytes as UTF-8): ``nemo-dapo train`` asks before Ray starts, and reads the rows while its
    workers load, so a file no row can come from is refused before anything starts."""
    for path in map(Path, paths):
        if _format_of(path) == ".parquet":
            try:
                pq.read_metadata(path)
            except pa.ArrowInvalid as error:
                raise _not_parquet(path, error) from None
        else:
            for _ in _utf8_lines(path):
                pass


def _format_of(path: Path) -> str:
    """The file's format by its extension, once the file is known to be there."""
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".jsonl"):
        raise DatasetError(f"{path}: unsupported file extension {suffix!r}; expected .parquet or .jsonl")
    return suffix


def _not_parquet(path: Path, error: Exception) -> DatasetError:
    return DatasetError(
        f"{path}: not a parquet file pyarrow can read ({error}); write it with pandas' to_parquet or "
        "pyarrow, or give the rows as a .jsonl file"
    )


def _iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, row)`` pairs, choosing the reader from the file extension."""
    if _format_of(path) == ".jsonl":
        yield from _iter_jsonl_rows(path)
        return
    try:
        table = pq.read_table(path)
    except pa.ArrowInvalid as error:
        raise _not_parquet(path, error) from None
    for row_index, row in enumerate(table.to_pylist()):
        yield f"{path} row {row_index}", row


def _utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The file's lines, numbered from 1, as UTF-8 text; a line that is not is refused, naming it."""
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DatasetError(
                    f"{path} line {line_number}: not UTF-8 text (byte {raw[error.start : error.start + 1]!r} at "
                    f"column {error.start + 1}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            yield line_number, line


def _iter_jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Rows are the non-blank lines; the location also gives the 1-based line number for editors."""
    row_index = 0
    for line_number, line in _utf8_lines(path):
        if not line.strip():
            continue
        location = f"{path} row {row_index} (line {line_number})"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{location}: invalid JSON ({error.msg})") from error
        yield location, row
        row_index += 1


def validate_row(row: Any, location: str) -> PromptRecord:
    """Check one row's fields and types; raise DatasetError naming ``location`` and the field."""
    if not isinstance(row, dict):
        raise DatasetError(f"{location}: expected an object with fields prompt, data_source, reward_model")
    messages = _validate_messages(row, location)
    data_source = _required(row, "data_source", str, location, "each row needs data_source=str")
    reward_model = _required(row, "reward_model", dict, location, _REWARD_HINT)
    extra_info = _optional(row, "extra_info", dict, location)
    ground_truth = _required(reward_model, "ground_truth", str, location, _REWARD_HINT, "reward_model.")
    if not ground_truth.strip():
        raise DatasetError(
            f"{location}: field 'reward_model.ground_truth' is empty ({ground_truth!r}); every row needs the "
            "answer its responses are scored against: fix or drop the row"
        )
    return PromptRecord(
        messages=messages,
        data_source=data_source,
        ground_truth=ground_truth,
        reward_style=_optional(reward_model, "style", str, location, "reward_model."),
        extra_info=dict(extra_info) if extra_info is not None else {},
        ability=_optional(row, "ability", str, location),
        location=location,
    )


def _validate_messages(row: dict, location: str) -> list[dict[str, str]]:
    """The prompt must be a non-empty list of {role, content} messages with a known role."""
    prompt = _required(row, "prompt", list, location, _PROMPT_HINT)
    if not prompt:
        raise DatasetError(f"{location}: field 'prompt' is an empty list; {_PROMPT_HINT}")
    messages = []
    for position, message in enumerate(prompt):
        field = f"prompt[{position}]"
        if not isinstance(message, dict):
            raise DatasetError(
                f"{location}: field '{field}' must be a message object, got {type(message).__name__}; {_PROMPT_HINT}"
            )
        role = _required(message, "role", str, location, _PROMPT_HINT, f"{field}.")
        if role not in MESSAGE_ROLES:
            raise DatasetError(f"{location}: field '{field}.role' is {role!r}; expected one of {MESSAGE_ROLES}")
        content = _required(message, "content", str, location, _PROMPT_HINT, f"{field}.")
        messages.append({"role": role, "content": content})
    return messages


def _required(container: dict, key: str, expected: type, location: str, hint: str, prefix: str = "") -> Any:
    """Fetch a field that must be present, non-null and of type ``expected``."""
    value = container.get(key)
    if value is None:
        raise DatasetError(f"{location}: field '{prefix}{key}' is missing; {hint}")
    return _check_type(value, expected, f"{prefix}{key}", location)


def _optional(container: dict, key: str, expected: type, location: str, prefix: str = "") -> Any:
    """Fetch a field that may be absent or null, but has type ``expected`` when present."""
    value = container.get(key)
    if value is None:
        return None
    return _check_type(value, expected, f"{prefix}{key}", location)


def _check_type(value: Any, expected: type, field: str, location: str) -> Any:
    if not isinstance(value, expected):
        wanted = _TYPE_NAMES[expected]
        raise DatasetError(f"{location}: field '{field}' must be {wanted}, got {type(value).__name__} ({value!r:.60})")
    return value
