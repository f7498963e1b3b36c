"""Writing into a folder the user named without ever deleting what was there.

``nemo-dapo export`` and ``nemo-dapo import-gguf`` write into a folder given on the command
line: a mistyped path must not cost the user a folder. A folder that exists and holds anything
is refused unless the command was told ``--overwrite``, and even then only the model is replaced
(its weight files as a whole: shards of an older model must not mix with the new ones) and the
files the command writes; every other file stays.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nemo_dapo.errors import InputError


def check_target(folder: Path, overwrite: bool, what: str) -> None:
    """Refuse to write ``what`` into a non-empty ``folder`` (or onto a file) unless ``overwrite``."""
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder}: is a file, not a folder; give a folder for {what}")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise InputError(
            f"{folder}: exists and is not empty; write {what} into a new folder, or pass --overwrite to "
            "replace the model there (its weight files and the files written; other files are kept)"
        )


def place(staging: Path, folder: Path) -> None:
    """Make ``staging`` (a sibling of ``folder``) the content of ``folder``: one rename when
    ``folder`` does not exist (an interrupted write leaves no half folder), else each file moved
    in, replacing the file of the same name; files of ``folder`` that ``staging`` does not hold stay."""
    if not folder.exists():
        staging.rename(folder)
        return
    for source in sorted(staging.rglob("*")):
        if source.is_file():
            target = folder / source.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)
    shutil.rmtree(staging)


def weight_files(folder: Path) -> list[Path]:
    """A Hugging Face folder's weights: its safetensors shards and their index."""
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.safetensors.index.json"))


def place_model(staging: Path, folder: Path) -> None:
    """:func:`place` for a model folder: the weight files ``folder`` held are removed first."""
    if folder.is_dir():
        for old in weight_files(folder):
            old.unlink()
    place(staging, folder)
