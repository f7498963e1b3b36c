"""Node-local folders in a temporary folder (where anyone may make a folder first) are this
user's alone: a Slurm job's Ray folder and compile caches (each node's preflight,
slurm/ray_node.sh) and a local Ray's folder (nemo_dapo/cluster/ray_env.py) are made with mode
0700, or reused only when they are this user's, no link, and writable by no one else; otherwise
they are refused, naming the folder and the setting that moves it. (The tests run as root: the
other user is 65534, as in test_slurm.py's state-folder test.)"""

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from nemo_dapo.cluster.ray_env import private_folder, private_ray_folder
from nemo_dapo.errors import InputError

REPO = Path(__file__).resolve().parents[1]
PLANTED = ("another user's", "mode 0777", "a link")


def mode(folder: Path) -> int:
    return folder.stat().st_mode & 0o777


def plant(folder: Path, case: str) -> None:
    """A folder someone else could have made first, or filled."""
    if case == "a link":
        target = folder.with_name("target")
        target.mkdir(mode=0o700)
        folder.symlink_to(target)
    else:
        folder.mkdir(mode=0o700)
        if case == "mode 0777":
            folder.chmod(0o777)
        else:
            os.chown(folder, 65534, 65534)


def preflight(tmp_path: Path, **folders: str) -> subprocess.CompletedProcess:
    """slurm/ray_node.sh's preflight on this machine (no GPUs, no free-space floor)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FABRIC_IFNAME", "NODE_CHECK", "NODE_CACHE_DIR")}
    env |= {"RAY_FAILED_NODES": str(tmp_path / "failed_nodes"), "NODE_MIN_FREE_GIB": "0", "RAY_GPUS_PER_NODE": "0"}
    env |= {"SLURMD_NODENAME": "node01", "RAY_LOG_DIR": str(tmp_path / "logs"), "RAY_RUN_TAG": "r0", **folders}
    script = REPO / "slurm" / "ray_node.sh"
    return subprocess.run(["bash", str(script), "preflight"], env=env, capture_output=True, text=True, timeout=60)


def test_the_preflight_makes_the_jobs_ray_folder_and_caches_private(tmp_path):
    ray_folder, caches = tmp_path / "ray_7", tmp_path / "node" / "nemo-dapo-cache-root"
    done = preflight(tmp_path, RAY_TEMP_DIR=str(ray_folder), NODE_CACHE_DIR=str(caches))
    assert done.returncode == 0, done.stderr
    assert mode(ray_folder) == mode(caches) == 0o700
    ray_folder.chmod(0o755)  # this user's, from an older run: nobody else could write it; closed again
    assert preflight(tmp_path, RAY_TEMP_DIR=str(ray_folder)).returncode == 0 and mode(ray_folder) == 0o700


@pytest.mark.parametrize("case", PLANTED)
def test_the_preflight_refuses_a_ray_folder_someone_else_could_have_planted_files_in(tmp_path, case):
    folder = tmp_path / "ray_7"
    plant(folder, case)
    before = folder.lstat()
    done = preflight(tmp_path, RAY_TEMP_DIR=str(folder))
    assert done.returncode == 1, done.stderr
    assert f"{folder}: not a folder of root's that only root can write" in done.stderr
    assert "remove it, or set RAY_TEMP_DIR to a new path" in done.stderr
    assert (tmp_path / "failed_nodes").read_text().startswith(f"node01: {folder}: not a folder")
    after = folder.lstat()
    assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)  # left as it was


def test_the_preflight_refuses_caches_of_another_user(tmp_path):
    caches = tmp_path / "nemo-dapo-cache-root"
    plant(caches, "another user's")
    done = preflight(tmp_path, RAY_TEMP_DIR=str(tmp_path / "ray_7"), NODE_CACHE_DIR=str(caches))
    assert done.returncode == 1 and "or set NODE_CACHE_DIR to a new path" in done.stderr, done.stderr


def test_a_local_ray_folder_is_private_and_a_planted_one_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = tmp_path / f"nemo-dapo-{os.getuid()}"
    assert private_ray_folder() == folder / "ray" and mode(folder) == 0o700
    for case in PLANTED:
        planted = tmp_path / case.replace(" ", "_").replace("'", "")
        plant(planted, case)
        with pytest.raises(InputError, match=rf"{planted}: not a folder of this user's .* or set TMPDIR to another"):
            private_folder(planted, "TMPDIR")


def test_the_local_ray_runs_in_this_users_private_folder(local_ray):
    from ray._private.worker import global_worker

    temp_dir = Path(global_worker.node.get_temp_dir_path())
    assert temp_dir == Path(tempfile.gettempdir()) / f"nemo-dapo-{os.getuid()}" / "ray"
    assert mode(temp_dir.parent) == 0o700 and temp_dir.parent.stat().st_uid == os.getuid()
