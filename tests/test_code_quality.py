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


MODULE_LINES, FUNCTION_LINES = 450, 60  # the size budget (docs/architecture.md, "Code size")


def over_budget(root: Path) -> list[str]:
    """Modules longer than MODULE_LINES and functions (their ``def`` to their last line) longer
    than FUNCTION_LINES under ``root``."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(root.parent)
        if source.count("\n") > MODULE_LINES:
            found.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_module_or_function_is_over_the_size_budget(tmp_path):
    assert over_budget(REPO / "nemo_dapo") == []
    planted = tmp_path / "nemo_dapo"
    planted.mkdir()
    (planted / "long.py").write_text("def f():\n" + "    x = 1\n" * FUNCTION_LINES + "\n" * MODULE_LINES)
    assert over_budget(planted) == [
        f"nemo_dapo/long.py: {MODULE_LINES + FUNCTION_LINES + 1} lines",
        f"nemo_dapo/long.py:1 f: {FUNCTION_LINES + 1} lines",
    ]
