"""The schema as data: every leaf setting with its help, type, default and allowed values.

One walk over the dataclasses of ``config/schema.py`` serves start-up validation (the allowed
values) and the reference (``config/reference.py``: ``--explain`` and docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from nemo_dapo.config.schema import Config


@dataclass(frozen=True)
class Setting:
    """One leaf of the schema, e.g. ``actor.clip_ratio_high``."""

    key: str
    type_name: str
    default: Any
    help: str
    declared_choices: Any  # a tuple, a function returning the names of a registry, or None
    bounds: str | None = None  # ">= 1", "> 0", "[0, 1)", ...: see schema.setting

    @property
    def choices(self) -> tuple | None:
        found = self.declared_choices
        return tuple(found()) if callable(found) else found

    def in_bounds(self, value: Any) -> bool:
        """Whether a number lies within :attr:`bounds` (null passes where the field is optional)."""
        if self.bounds is None or (value is None and self.type_name.endswith("or null")):
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return all(_COMPARE[op](value, limit) for op, limit in _limits(self.bounds))

    def bounds_text(self) -> str:
        """How a validation message says the bounds: ``must be >= 1``, ``must be in [0, 1)``."""
        text = f"in {self.bounds}" if self.bounds and self.bounds[0] in "[(" else self.bounds
        return f"must be {text}" + (" or null" if self.type_name.endswith("or null") else "")

    def value_in(self, cfg: Config) -> Any:
        value = cfg
        for part in self.key.split("."):
            value = getattr(value, part)
        return value

    def allowed_text(self) -> str:
        """The choices as validation names them: declared order with null, else sorted."""
        choices = self.choices
        if None in choices:
            return str(["null" if c is None else c for c in choices])
        return str(sorted(map(str, choices)))


_COMPARE = {
    ">=": lambda v, x: v >= x,
    ">": lambda v, x: v > x,
    "<=": lambda v, x: v <= x,
    "<": lambda v, x: v < x,
}


def _limits(bounds: str) -> list[tuple[str, float]]:
    """``">= 1"`` -> [(">=", 1.0)]; ``"(0, 1]"`` -> [(">", 0.0), ("<=", 1.0)]."""
    if bounds[0] in "[(":
        low, high = (float(part) for part in bounds[1:-1].split(","))
        return [(">=" if bounds[0] == "[" else ">", low), ("<=" if bounds[-1] == "]" else "<", high)]
    op, limit = bounds.split()
    return [(op, float(limit))]


def _type_name(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union:
        return f"{_type_name(args[0])} or null"
    if typing.get_origin(annotation) is list:
        return f"list of {_type_name(args[0])}"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _walk(cls: type, prefix: str) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if dataclasses.is_dataclass(annotation):
            yield from _walk(annotation, f"{prefix}{field.name}.")
            continue
        yield Setting(
            f"{prefix}{field.name}",
            _type_name(annotation),
            _default(field),
            field.metadata.get("help", ""),
            field.metadata.get("choices"),
            field.metadata.get("bounds"),
        )


@lru_cache(maxsize=1)
def settings() -> dict[str, Setting]:
    """Every leaf setting by dotted key, in schema order."""
    return {s.key: s for s in _walk(Config, "")}


def section_help() -> dict[str, str]:
    """The help text of every nested group (``actor.megatron``, ...), by dotted key."""
    found: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[field.name]):
                found[prefix + field.name] = field.metadata.get("help", "")
                walk(hints[field.name], f"{prefix}{field.name}.")

    walk(Config, "")
    return found
