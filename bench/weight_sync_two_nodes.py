"""The weight sync across two nodes of the namespace cluster: ``bench/weight_sync.py --across-nodes``
as a Slurm job on two nodes of tests/slurm/setup_netns_slurm.sh (Ray started by
slurm/ray_cluster.sh), the policy rank on one node and the engine on the other.

    .venv/bin/python bench/weight_sync_two_nodes.py [--hidden 1024] [--layers 8] [--syncs 3]

The nodes are network namespaces on this machine joined by a bridge (veth pairs): the bytes are
what crosses a node's interface, the seconds those of a link that is memory-speed, not a
datacenter network. Prints the JSON of bench/weight_sync.py. Needs root; not in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from control_plane import SETUP, cluster_env, setup

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.slurm_jobs import submit  # noqa: E402 (the test suite's job helpers, on the repository root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--syncs", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/weight_sync_two_nodes.py: network namespaces and slurmd need root")
    work = Path(tempfile.mkdtemp(prefix="weight_sync_two_nodes_", dir="/tmp"))
    env = cluster_env(2, work)
    subprocess.run(["bash", str(SETUP), "stop"], capture_output=True, env=env, timeout=300)
    try:
        setup(env, "start")
        command = [sys.executable, "bench/weight_sync.py", "--across-nodes", "--tp", "1", "--engine-tp", "1"]
        command += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--syncs", str(args.syncs)]
        job_env = {**env, "RAY_GPUS_PER_NODE": "0", "LOG_DIR": str(work / "logs"), "FABRIC_IFNAME": "ib0"}
        prefix = ("bash", str(SETUP), "exec", "ctl")
        job = submit(job_env, work / "job.out", "slurm/ray_cluster.sh", [*command, "--workdir", str(work)],
                     sbatch_args=["--nodes=2", "--ntasks-per-node=1"], prefix=prefix)  # fmt: skip
        deadline = time.monotonic() + 1800
        while job.field("JobState") in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
            if time.monotonic() > deadline:
                sys.exit(f"no result after 30 minutes:\n{job.log()[-3000:]}")
            time.sleep(2)
        log = job.log()
        start = log.rfind('{\n  "model_mib"')
        if job.field("JobState") != "COMPLETED" or start < 0:
            sys.exit(f"job {job.id}: {job.field('JobState')}\n{log[-4000:]}")
        print(json.dumps(json.JSONDecoder().raw_decode(log[start:])[0], indent=2))
    finally:
        subprocess.run(["bash", str(SETUP), "stop"], capture_output=True, timeout=300)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
