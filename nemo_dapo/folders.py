"""Writing into a folder the user named without ever deleting what was there.

``nemo-dapo export`` and ``nemo-dapo import-gguf`` write into a folder given on the command
line: a mistyped path must not cost the user a folder. A folder that exists and holds anything
is refused unless the command was told ``--overwrite``, and even then only the model is replaced
(its weight files as a whole: shards of an older model must not mix with the new ones) and the
files the command writes; every other file stays.

A run's output folder may be shared with others who can write into it: a link planted at the
name of a file a run writes would make the run overwrite the link's target. Such files are
opened here without following links (:func:`open_run_file`, :func:`replace_file`).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO

from nemo_dapo.errors import InputError


def check_target(folder: Path, overwrite: bool, what: str) -> None:
    """Refuse to write ``what`` into a non-empty ``folder`` (or onto a file, or through a link)
    unless ``overwrite``."""
    if folder.is_symlink():  # in a shared folder, placed to make the write replace another folder's files
        raise InputError(f"{folder}: is a link; give the folder it points to ({folder.resolve()}) for {what}")
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


class NotPlainFile(InputError):
    """A file that a link, a FIFO, a device or another name (a hard link, for a file written)
    would turn into another file, or a wait for a writer that never comes."""


def open_plain(path: str | Path, flags: int, dir_fd: int | None = None) -> int:
    """``os.open(path, flags)`` that follows no link at the name and never waits on a FIFO: what
    it opens must be a regular file (a folder with ``O_DIRECTORY``), one with a single name when
    it is opened to be written (a second name is a hard link to a file someone else reads);
    :class:`NotPlainFile` otherwise, naming it. Its callers add what to do."""
    kind = "folder" if flags & os.O_DIRECTORY else "plain file"
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR):  # a link; a FIFO nobody reads; a file
            raise NotPlainFile(f"{path}: a link, or not a {kind}") from None
        raise
    found = os.fstat(fd)
    plain = stat.S_ISDIR(found.st_mode) if flags & os.O_DIRECTORY else stat.S_ISREG(found.st_mode)
    if not plain or (flags & (os.O_WRONLY | os.O_RDWR) and found.st_nlink > 1):
        os.close(fd)
        raise NotPlainFile(f"{path}: not a {kind} (a FIFO, a device, a folder, or a file with other names)")
    return fd


# how each mode of :func:`open_run_file` opens: never truncating (a file opened to be rewritten
# is replaced by :func:`replace_file` instead)
_OPEN_FLAGS = {"a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND}


def open_run_file(path: Path, mode: str = "a") -> IO[str]:
    """``path``, a file of an output folder, opened (created if missing) to append to it by
    :func:`open_plain`: a link planted there is refused, never written through."""
    try:
        return os.fdopen(open_plain(path, _OPEN_FLAGS[mode]), mode, encoding="utf-8")
    except NotPlainFile as err:
        raise NotPlainFile(
            f"{err}; a run writes it in its output folder and would write into what it points to: move it "
            "away (someone who can write into the folder placed it), and keep the folder writable by its owner only"
        ) from None


def replace_file(path: Path, text: str) -> None:
    """Make ``path`` hold ``text``, atomically: a new file under a random name beside it (created
    with ``O_EXCL``, which follows no link planted there), synced to disk, then renamed over
    ``path`` (a rename replaces a link planted at ``path``, never its target). A crash or a full
    disk mid-write leaves the previous content; the new file is removed."""
    staged = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staged, path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
