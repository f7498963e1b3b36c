"""`make test`'s two lanes (tests/lanes.py), run on a small suite of their own: the multi-node
module on one worker beside the rest on the other, and a ``quiet`` test only after the
multi-node lane is done."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = """
import json, os, time
from pathlib import Path

def record(name, seconds=0.0):
    start = time.time()
    time.sleep(seconds)
    row = {"name": name, "worker": os.environ.get("PYTEST_XDIST_WORKER"), "start": start, "end": time.time()}
    with open(Path(__file__).parents[1] / "record.jsonl", "a") as out:
        out.write(json.dumps(row) + "\\n")
"""


def test_the_multi_node_lane_runs_beside_the_rest_and_quiet_tests_after_it(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "record.py").write_text(RECORD)
    (tmp_path / "tests" / "conftest.py").write_text('pytest_plugins = ["tests.lanes"]\n')
    (tmp_path / "tests" / "lanes.py").write_text((REPO / "tests" / "lanes.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    quiet: last\n")
    (tmp_path / "tests" / "test_multinode.py").write_text(
        "from tests.record import record\n\ndef test_cluster():\n    record('cluster', 4)\n"
    )
    (tmp_path / "tests" / "test_local.py").write_text(
        "import pytest\nfrom tests.record import record\n\n"
        "@pytest.mark.quiet\ndef test_quiet():\n    record('quiet')\n\n"
        "def test_first():\n    record('first', 1)\n\ndef test_second():\n    record('second', 1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q", "tests"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["name"]: row for row in map(json.loads, (tmp_path / "record.jsonl").read_text().splitlines())}
    cluster = rows.pop("cluster")
    assert {row["worker"] for row in rows.values()} == {"gw0", "gw1"} - {cluster["worker"]}  # one lane
    assert rows["first"]["end"] <= rows["second"]["start"]  # in file order, one after the other
    assert rows["first"]["start"] < cluster["end"]  # beside the multi-node lane
    assert rows["quiet"]["start"] >= cluster["end"] and rows["quiet"]["start"] >= rows["second"]["end"]
