"""How long do a checkpoint's commit (manifest) and its resume check take, before and after?

    .venv/bin/python bench/checkpoint_digest.py [--gib 6] [--files 12] [--ranks 2] [--folder /var/tmp/...]

Writes a checkpoint-shaped folder of ``--gib`` GiB of random bytes in ``--files`` shards, then in
one run times, for each way of computing the manifest's digests:

- before: SHA-256 of every file on one thread in the driver (the former manifest);
- driver: BLAKE3 in the driver, each file with BLAKE3's own threads (nemo_dapo.digest's default);
- ranks: BLAKE3 computed by ``--ranks`` torch policy workers (Ray actors), each over a share of
  the files of about equal bytes: the trainer's hasher (``PolicyGroup.digest_files``).

Each is timed at commit (the files just written, in the page cache) and at resume (page cache
dropped first, as root: the files come from the disk, as after a requeue on another node).
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

from nemo_dapo.cluster.groups import PolicyGroup
from nemo_dapo.cluster.ray_env import init_ray, shutdown_ray
from nemo_dapo.cluster.worker_group import GroupSpec, WorkerGroup
from nemo_dapo.config.schema_actor import OptimConfig
from nemo_dapo.digest import digest_files
from nemo_dapo.model.tiny import ensure_tiny_model
from nemo_dapo.policy.torch_worker import TorchPolicyWorker
from nemo_dapo.trainer.checkpoint import write_manifest


def sha256_one_thread(folder: Path, names) -> dict[str, str]:
    """The manifest's digests before: SHA-256, 1 MiB reads, one file after the other, one thread."""
    found = {}
    for name in names:
        digest = hashlib.sha256()
        with open(folder / name, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        found[name] = digest.hexdigest()
    return found


def write_shards(folder: Path, gib: float, files: int) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_file = int(gib * (1 << 30)) // files
    for index in range(files):
        (folder / f"__{index}_0.distcp").write_bytes(rng.bytes(per_file))


def drop_page_cache() -> bool:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=6.0)
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--folder", default="/var/tmp/nemo-dapo-bench-digest")
    args = parser.parse_args()
    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)
    write_shards(folder, args.gib, args.files)
    init_ray(num_cpus=max(2, args.ranks))
    workers = WorkerGroup(
        TorchPolicyWorker,
        GroupSpec("digest_bench", args.ranks),
        {"model_path": str(ensure_tiny_model()), "optim": OptimConfig()},
    )
    group = PolicyGroup(workers)
    hashers = {"before_sha256_driver_1thread": sha256_one_thread, "blake3_driver": digest_files}
    hashers[f"blake3_{args.ranks}_ranks"] = group.digest_files
    names = sorted(p.name for p in folder.iterdir())
    reference = None
    try:
        for moment in ("commit", "resume"):
            for label, hasher in hashers.items():
                cold = drop_page_cache() if moment == "resume" else False
                start = time.perf_counter()
                if moment == "commit":
                    write_manifest(folder, hasher)
                    found = None
                else:
                    found = hasher(folder, names)
                seconds = time.perf_counter() - start
                if found is not None and "blake3" in label:
                    reference = reference or found
                    assert found == reference, "the ranks and the driver disagree"
                print(
                    json.dumps(
                        {
                            "moment": moment,
                            "hasher": label,
                            "gib": round(args.gib, 2),
                            "files": args.files,
                            "seconds": round(seconds, 2),
                            "gib_per_s": round(args.gib / seconds, 2),
                            "page_cache_dropped": cold,
                        }
                    ),
                    flush=True,
                )
    finally:
        workers.shutdown()
        shutdown_ray()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
