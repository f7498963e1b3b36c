"""The linter, the formatter and the type checker pass on the whole repository (pinned versions,
settings in pyproject.toml), so style and interface drift fail here instead of in review."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)


def test_ruff_lint_passes():
    done = run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout[-6000:]


def test_ruff_format_leaves_every_file_unchanged():
    done = run(str(BIN / "ruff"), "format", "--check", "--no-cache", ".")
    assert done.returncode == 0, f"run `ruff format .`:\n{done.stdout[-4000:]}"


@pytest.mark.slow
def test_mypy_passes_on_the_trainer_cluster_policy_and_rollout_layers():
    done = run(sys.executable, "-m", "mypy", "--no-incremental")
    assert done.returncode == 0, done.stdout[-6000:]
