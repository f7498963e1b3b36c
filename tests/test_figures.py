"""The README and docs/benchmarks.md show one table of current figures, each with the machine it
ran on (tools/figures.py copies it)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from figures import readme_table, with_table  # noqa: E402


def test_the_readme_shows_the_current_figures_of_docs_benchmarks():
    readme = (REPO / "README.md").read_text()
    table = readme_table((REPO / "docs" / "benchmarks.md").read_text())
    assert with_table(readme, table) == readme, "the README's figures differ: run `python tools/figures.py`"
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    assert rows[0][2].strip() == "ran on" and len(rows) > 5 and all(len(cells) == 4 for cells in rows)
    assert "](docs/benchmarks.md#embedded-default" in table and "](docs/testing.md#" in table
    stale = with_table(readme, table.replace("292 s", "291 s"))
    assert with_table(stale, table) != stale  # a changed figure is noticed
