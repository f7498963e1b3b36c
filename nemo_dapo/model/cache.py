"""The local cache of built-in models: each built once into a folder named by a hash of its recipe."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return Path(os.environ.get("NEMO_DAPO_CACHE", Path.home() / ".cache" / "nemo_dapo"))


def cached_build(
    name: str,
    build: Callable[[Path], object],
    cache_dir: str | Path | None = None,
    done_marker: str = "model.safetensors",
) -> Path:
    """``cache_dir/name``, built by ``build(staging)`` the first time (atomically: a staging folder,
    then a rename, so an interrupted build never looks finished and concurrent builds are safe)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / name
    if (target / done_marker).exists():
        return target
    staging = root / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    log.info("building %s into %s (cached for later runs)", name, target)
    build(staging)
    try:
        staging.rename(target)
    except OSError:  # another process won the race: use its copy
        shutil.rmtree(staging, ignore_errors=True)
    return target
