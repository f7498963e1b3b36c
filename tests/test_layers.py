"""Imports point down only: the layer diagram in docs/architecture.md is the rule, read from the
page itself, and every ``nemo_dapo`` import in the package is held to it."""

import ast
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIAGRAM_START = "One folder per layer"


def layer_rows(page: Path) -> dict[str, int]:
    """``{"trainer": 1, "cli": 0, ...}``: each package folder or top-level module with the row of
    the diagram it is on (0 is the top). A row starts at the line's first column; its names are
    its first words ending in ``/`` or ``.py``, the description follows."""
    text = page.read_text()
    block = text[text.index(DIAGRAM_START) :].split("```")[1]
    rows: dict[str, int] = {}
    lines = [line for line in block.splitlines() if line and not line[0].isspace()]
    for row, line in enumerate(lines):
        for word in line.split():
            if not word.endswith(("/", ".py")):
                break  # the description
            rows[word.removesuffix("/").removesuffix(".py")] = row
    return rows


def unit_of(path: Path, package: Path) -> str:
    parts = path.relative_to(package).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def imported_units(tree: ast.AST) -> set[str]:
    units = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        units |= {name.split(".")[1] for name in names if name.startswith("nemo_dapo.")}
    return units


def wrong_imports(package: Path, rows: dict[str, int]) -> list[str]:
    problems = []
    for path in sorted(package.rglob("*.py")):
        unit = unit_of(path, package)
        if unit == "__init__":
            continue
        assert unit in rows, f"{path}: {unit} is on no row of the layer diagram in docs/architecture.md"
        for target in sorted(imported_units(ast.parse(path.read_text())) - {unit, "__init__"}):
            if rows[target] <= rows[unit]:
                where = "beside" if rows[target] == rows[unit] else "above"
                problems.append(f"{path.relative_to(package.parent)} imports {target} ({where} {unit})")
    return problems


def test_every_import_points_down_the_documented_layers():
    rows = layer_rows(REPO / "docs" / "architecture.md")
    assert rows["cli"] == 0 and rows["commands"] < rows["trainer"] < rows["cluster"] < rows["algo"] < rows["errors"]
    assert wrong_imports(REPO / "nemo_dapo", rows) == []


def test_an_upward_import_is_found(tmp_path):
    """The check itself: an import planted in a copy, from algo up to the trainer."""
    package = tmp_path / "nemo_dapo"
    shutil.copytree(REPO / "nemo_dapo", package, ignore=shutil.ignore_patterns("__pycache__"))
    planted = package / "algo" / "advantage.py"
    planted.write_text("from nemo_dapo.trainer.fit import DAPOTrainer\n" + planted.read_text())
    rows = layer_rows(REPO / "docs" / "architecture.md")
    assert wrong_imports(package, rows) == ["nemo_dapo/algo/advantage.py imports trainer (above algo)"]
