"""Content digests of checkpoint files, computed where the files are: BLAKE3 over a memory map.

A checkpoint's manifest records a digest of every file so that a damaged one is refused at
resume. At the 32B size a checkpoint is about half a terabyte, so the digests are computed by
the training ranks in parallel, each over a share of the files balanced by size
(:func:`shares_by_size`), and each file with BLAKE3's own threads: no single thread reads every
byte (docs/architecture.md, checkpoints). BLAKE3 is a cryptographic hash, ~3x faster per core
than SHA-256 here, and parallel within one file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

ALGORITHM = "blake3"


def file_digest(path: str | Path) -> str:
    import blake3

    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if os.path.getsize(path):  # an empty file cannot be memory-mapped
        hasher.update_mmap(str(path))
    return hasher.hexdigest()


def legacy_sha256(path: str | Path) -> str:
    """The digest of manifests written before BLAKE3 (read when such a checkpoint resumes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def digest_files(folder: str | Path, names: Sequence[str]) -> dict[str, str]:
    """``{name: digest}`` of the files ``folder/name``."""
    return {name: file_digest(Path(folder) / name) for name in names}


def shares_by_size(folder: str | Path, names: Sequence[str], parts: int) -> list[list[str]]:
    """``names`` split into ``parts`` lists of about equal bytes (largest file first, each to the
    lightest share)."""
    shares: list[list[str]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for size, name in sorted(((os.path.getsize(Path(folder) / n), n) for n in names), reverse=True):
        lightest = loads.index(min(loads))
        shares[lightest].append(name)
        loads[lightest] += size
    return shares
