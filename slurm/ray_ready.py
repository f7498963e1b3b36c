"""Waits, in one process, until every node of the job joined the Ray cluster with its GPUs and CPUs.

Run by slurm/ray_cluster.sh on the head node (in the job's container, with $PYTHON) once the
head's port answers:

    python ray_ready.py SECONDS NODES GPUS CPUS NAME=ADDRESS...

Exit 0 with the cluster's shape on stdout; exit 1 after SECONDS naming the nodes that never
joined (by name and address, as Ray lists them: its hostname or its node address), one per
line as ``missing NAME``, which the batch shell names as failed nodes.
"""

import sys
import time


def main(argv: list[str]) -> int:
    seconds, nodes, gpus, cpus = (float(x) for x in argv[:4])
    expected = dict(item.split("=", 1) for item in argv[4:])  # node name -> address
    import ray

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + seconds
    while True:
        alive = [node for node in ray.nodes() if node["Alive"]]
        resources = ray.cluster_resources()
        have_gpus, have_cpus = resources.get("GPU", 0), resources.get("CPU", 0)
        state = f"nodes {len(alive)}/{nodes:.0f}, GPU {have_gpus:.0f}/{gpus:.0f}, CPU {have_cpus:.0f}/{cpus:.0f}"
        if len(alive) >= nodes and have_gpus >= gpus and have_cpus >= cpus:
            print(state, flush=True)
            return 0
        if time.monotonic() > deadline:
            seen = {node["NodeManagerHostname"].split(".")[0] for node in alive}  # node001.site -> node001
            seen |= {node["NodeManagerAddress"] for node in alive}
            missing = [name for name, address in expected.items() if name not in seen and address not in seen]
            print(state + "".join(f"\nmissing {name} ({expected[name]})" for name in missing), flush=True)
            return 1
        time.sleep(2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
