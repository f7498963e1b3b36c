"""How a config field is declared: :func:`setting` (a leaf with its help text, allowed values or
bounds) and :func:`section` (a nested section with its help). The schema's modules use them; the
metadata they leave is what ``config/fields.py`` reads for validation and the reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, field
from typing import Any

Choices = tuple | Callable[[], Any]


def setting(
    default: Any = MISSING,
    *,
    help: str,
    choices: Choices | None = None,
    bounds: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A schema field with its help text and the values validation accepts: ``choices`` for
    enumerations, ``bounds`` for numbers.

    ``choices`` is a tuple, or a function returning the names of a registry that users can
    extend (advantage estimators). ``None`` inside the tuple means null is one of the choices.
    ``bounds`` is ``">= 1"``, ``"> 0"`` (likewise ``<=``, ``<``) or an interval such as
    ``"[0, 1)"``; an optional field may also be null.
    """
    metadata = {"help": " ".join(help.split())}
    if choices is not None:
        metadata["choices"] = choices
    if bounds is not None:
        metadata["bounds"] = bounds
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, help: str) -> Any:
    """A nested settings group, built from its class's defaults."""
    return field(default_factory=cls, metadata={"help": help})
