"""Argument checks shared by the scorers: a bad value should name the argument that carried it."""

from __future__ import annotations


def require_str(value: object, name: str) -> str:
    """Return ``value`` if it is a str, else raise a TypeError naming ``name``.

    A non-string response or ground truth is a data-pipeline bug (for example an int answer
    column); failing here is clearer than an AttributeError deep inside a regex.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}: {value!r:.80}")
    return value


def require_ground_truth(value: object, name: str) -> str:
    """Return a non-empty ground-truth string; an empty one is a dataset row without an answer.

    Both scorers reject it the same way, so switching scorer never changes which rows fail.
    """
    if not require_str(value, name).strip():
        raise ValueError(f"{name} is empty: the dataset row has no reference answer")
    return value
