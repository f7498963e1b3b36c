"""Start a local Ray bound to 127.0.0.1, or attach to an existing cluster.

Locally every Ray process must listen on loopback only. Ray picks the NIC address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is in the environment before ``import ray`` *and*
``_node_ip_address="127.0.0.1"`` is passed, so this module sets both. vLLM and
torch.distributed in the workers are pointed at loopback through the same environment. On a
cluster nothing network-related is forwarded from the driver: each worker picks its own node's
address (:mod:`nemo_dapo.network`).

A local Ray keeps its sessions in a folder of this user's alone (:func:`private_ray_folder`),
not in ``/tmp/ray``: Ray makes its folders writable by everyone, and files planted there (a
session's runtime environment, its sockets) would reach our workers.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from nemo_dapo.cluster.placement import pool_resource
from nemo_dapo.errors import InputError
from nemo_dapo.network import LOOPBACK

# every worker, on one machine or on a cluster
WORKER_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: no extra zmq sockets on CPU
    "TOKENIZERS_PARALLELISM": "false",
}
# a local run only: Ray, gloo and vLLM on loopback
LOOPBACK_ENV = {
    **WORKER_ENV,
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "VLLM_HOST_IP": LOOPBACK,
    "GLOO_SOCKET_IFNAME": "lo",
}


# a local Ray is one node of both pools: a layout with a rollout pool runs on it as on one node
LOCAL_POOLS = {pool_resource(pool): 1.0 for pool in ("train", "rollout")}


def is_attached_to_cluster() -> bool:
    return bool(os.environ.get("RAY_ADDRESS"))


def apply_loopback_env() -> None:
    """Set the loopback environment for this process (and the workers it starts)."""
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)


def init_ray(num_cpus: int | None = None, namespace: str = "nemo_dapo", num_gpus: int | None = None):
    """``ray.init`` on loopback, or attach to ``$RAY_ADDRESS`` (a Slurm-started cluster).

    ``num_gpus`` declares the local Ray's GPUs (None: detect them). Ray schedules on a declared
    count even without devices, which lets GPU placement run on a CPU machine (tests).
    """
    if not is_attached_to_cluster():
        apply_loopback_env()
    import ray

    if ray.is_initialized():
        return ray
    from nemo_dapo.logs import LOG_LEVEL_ENV, QUIET_ENV

    attached = is_attached_to_cluster()
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    # the workers print what the driver was told to
    forwarded = [*(WORKER_ENV if attached else LOOPBACK_ENV), LOG_LEVEL_ENV, *QUIET_ENV]
    env_vars = {k: os.environ[k] for k in forwarded if k in os.environ}
    env_vars["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH", "")]))
    runtime_env = {"env_vars": env_vars}
    if attached:
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=namespace, runtime_env=runtime_env, log_to_driver=True)
    else:
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            resources=LOCAL_POOLS,
            _node_ip_address=LOOPBACK,
            include_dashboard=False,
            namespace=namespace,
            runtime_env=runtime_env,
            log_to_driver=True,
            configure_logging=False,
            _temp_dir=str(private_ray_folder()),
        )
    return ray


def private_folder(folder: Path, setting: str) -> Path:
    """``folder``, made with mode 0700, or reused only when it is this user's, no link, and
    writable by no one else (then closed to 0700); anything else is refused, naming ``setting``,
    the setting that chooses another place. A temporary folder is everyone's: a folder someone
    else made first, or one others could write, may hold planted files."""
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass  # reused only if it passes the check below
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise InputError(
            f"{folder}: not a folder of this user's that only this user can write (someone else's, a link, or "
            f"one others could write may hold planted files); remove it, or set {setting} to another folder"
        )
    folder.chmod(0o700)
    return folder


def private_ray_folder() -> Path:
    """A local Ray's temporary folder: ``ray/`` inside this user's private folder in the
    temporary folder (``$TMPDIR``, else ``/tmp``). Ray makes ``ray/`` writable by everyone; the
    folder around it keeps everyone else out."""
    return private_folder(Path(tempfile.gettempdir()) / f"nemo-dapo-{os.getuid()}", "TMPDIR") / "ray"


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
