"""Two lanes for `make test` (pytest-xdist, ``-n 2``): the multi-node Slurm module and the
end-to-end training runs on one worker, everything else on the other, in file order with the
tests marked ``quiet`` last. The multi-node tests mostly wait for Slurm and Ray to start things (about 1.4 of
the 2 cores busy, as the rest), so side by side the suite takes the longer lane plus the
contention, not the sum (docs/testing.md). A ``quiet`` test measures time or memory, or holds deadlines of a few
seconds: it starts once the multi-node lane is done, with the machine to itself. Without xdist
(a plain `pytest ...`) only the order changes.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

# the multi-node module, then the end-to-end training runs: about the other lane's length (docs/testing.md)
CLUSTER_MODULES = ("tests/test_multinode.py", "tests/test_train_e2e.py", "tests/test_resume_e2e.py")
QUIET_WAIT_S = 1800  # a bound on the cluster lane (multi-node and end-to-end runs), which takes ~15 minutes
CLUSTER_LEFT = pytest.StashKey[int]()


def is_cluster(item: pytest.Item) -> bool:
    return item.nodeid.split("::")[0] in CLUSTER_MODULES


def lane_folder() -> Path | None:
    """Where the multi-node lane says it is done: a folder of this xdist run (None without xdist)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return Path(tempfile.gettempdir()) / f"nemo_dapo_lanes_{run}" if run else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("quiet") is not None)  # stable: file order kept


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's scheduler by scope, with two scopes: the cluster modules, and the rest."""
    from xdist.scheduler import LoadScopeScheduling

    class TwoLanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "cluster" if nodeid.split("::")[0] in CLUSTER_MODULES else "local"

    return TwoLanes(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[CLUSTER_LEFT] = sum(map(is_cluster, session.items))  # after -k / -m


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """The worker that ran the last multi-node test, whatever its outcome, says so."""
    result = yield
    folder = lane_folder()
    if folder is not None and is_cluster(item):
        item.config.stash[CLUSTER_LEFT] -= 1
        if item.config.stash[CLUSTER_LEFT] == 0:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "cluster_done").touch()
    return result


@pytest.fixture(autouse=True)
def quiet_machine(request: pytest.FixtureRequest) -> None:
    """A ``quiet`` test on the other lane waits for the multi-node lane to be done."""
    folder = lane_folder()
    if folder is None or request.node.get_closest_marker("quiet") is None:
        return
    if not request.config.stash.get(CLUSTER_LEFT, 0):  # no multi-node test in this run
        return
    deadline = time.monotonic() + QUIET_WAIT_S
    while not (folder / "cluster_done").exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the multi-node lane did not finish within {QUIET_WAIT_S} s")
        time.sleep(1)
