"""Policy, reference and rollout workers reuse the memory they free (nemo_dapo/cluster/allocator.py): the rule,
and that the settings really stop glibc from faulting freed blocks back in."""

import json
import os
import subprocess
import sys

import pytest

from nemo_dapo.cluster.allocator import REUSE_FREED_MEMORY, allocator_env, keeps_freed_memory

pytestmark = pytest.mark.quiet  # counts page faults

# frees and reallocates ten 40 MB blocks (above glibc's largest default mmap threshold, 32 MiB, as
# a vocabulary's logit chunk is) as a training pass frees its activations; prints the minor page
# faults of the last 10 rounds (the first round may fault the memory in once)
ROUNDS = """
import json, resource, torch
def round_():
    blocks = [torch.empty(10 << 20, dtype=torch.float32).fill_(1.0) for _ in range(10)]
    del blocks
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    round_()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def faults(env: dict[str, str]) -> int:
    base = {k: v for k, v in os.environ.items() if k not in REUSE_FREED_MEMORY}
    run = subprocess.run([sys.executable, "-c", ROUNDS], env={**base, **env}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_on_for_cpu_training_off_on_gpu_nodes_unless_set():
    assert keeps_freed_memory(None, on_gpu=False) and not keeps_freed_memory(None, on_gpu=True)
    assert keeps_freed_memory(True, on_gpu=True) and not keeps_freed_memory(False, on_gpu=False)
    assert allocator_env(False, {}) == {}
    assert allocator_env(True, {"PATH": "/bin"}) == REUSE_FREED_MEMORY
    # a value the user exported for the run wins
    mine = allocator_env(True, {"MALLOC_TRIM_THRESHOLD_": "1048576"})
    assert mine == {**REUSE_FREED_MEMORY, "MALLOC_TRIM_THRESHOLD_": "1048576"}


def test_freed_blocks_are_reused_without_page_faults():
    default = faults({})
    kept = faults(allocator_env(True, {}))
    # 10 rounds x 400 MB = 1M pages: glibc's default maps and faults them all again (measured
    # 1.02 M against 61 k kept)
    assert default > 500_000, default
    assert kept < default / 8, (kept, default)
