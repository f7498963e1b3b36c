"""The README's "Measured" table is docs/benchmarks.md's table of current figures: this copies
it into the README (links re-pointed from docs/ to the repository root);
``tests/test_figures.py`` fails when the README's copy differs. Run: ``python tools/figures.py``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- current figures: begin -->", "<!-- current figures: end -->"


def between_markers(text: str, source: str) -> tuple[int, int]:
    """Where the table lies in ``text``: the markers' offsets (refused, naming ``source``, without them)."""
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise SystemExit(f"{source}: no '{BEGIN}' ... '{END}' block")
    return start, stop + len(END)


def readme_table(benchmarks: str) -> str:
    """docs/benchmarks.md's table as the README shows it: a link into docs/ gets its folder."""
    start, stop = between_markers(benchmarks, "docs/benchmarks.md")
    table = benchmarks[start:stop]
    table = table.replace("](#", "](docs/benchmarks.md#")
    return re.sub(r"\]\((?!https?:|docs/|#)([\w./-]+\.md)", r"](docs/\1", table)


def with_table(readme: str, table: str) -> str:
    start, stop = between_markers(readme, "README.md")
    return readme[:start] + table + readme[stop:]


def main() -> int:
    readme = REPO / "README.md"
    table = readme_table((REPO / "docs" / "benchmarks.md").read_text())
    readme.write_text(with_table(readme.read_text(), table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
