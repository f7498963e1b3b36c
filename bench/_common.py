"""Command-line shape shared by the benchmarks."""

import argparse
import shutil
from pathlib import Path


def bench_parser(doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", default="tiny_cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*")
    return parser


def fresh_folder(path: Path) -> Path:
    """A bench run's own output folder, emptied: each measured run is a new run (nemo-dapo refuses a
    new run over an older one's checkpoints)."""
    shutil.rmtree(path, ignore_errors=True)
    return path
