"""The address a worker's own connections use, chosen on the node it runs on.

gloo (the training ranks' process groups; Megatron creates gloo groups even beside NCCL) and
vLLM's tensor-parallel ranks listen on one interface each. A worker takes the one that carries
its Ray node's address: on a local run (Ray on 127.0.0.1) that is loopback, on a cluster the
node's own address, which the other nodes reach. With ``FABRIC_IFNAME`` (the site's fast
network, ``slurm/site_env.sh``) it is that interface's address on the node instead: the bulk
traffic leaves Ray's management network. Settings already in the environment
(``GLOO_SOCKET_IFNAME``, ``VLLM_HOST_IP``) win.

A group's ranks meet at a torch.distributed TCPStore that the driver serves on its node's
address (:class:`Rendezvous`), never through files: a shared file system's locks (which a
FileStore needs) may not hold across nodes. The store has no authentication of its own: the
ranks seal what they keep there with a secret of the group's (:mod:`nemo_dapo.sealed_store`),
which reaches them inside the rendezvous URL through Ray calls and is never logged.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


def node_address() -> str:
    """This process's Ray node address; loopback outside Ray (a worker built directly, a test)."""
    import sys

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    return LOOPBACK


def interface_of(address: str) -> str:
    """The network interface that holds ``address`` (``lo`` for any loopback address)."""
    if ipaddress.ip_address(address).is_loopback:
        return "lo"
    import psutil

    for interface, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in addresses):
            return interface
    raise RuntimeError(
        f"no network interface of this node holds its Ray address {address}: set GLOO_SOCKET_IFNAME "
        "(and VLLM_HOST_IP) to the interface and address the nodes reach each other on"
    )


def own_address() -> str:
    """The address this process's connections use (module doc): ``VLLM_HOST_IP`` when set, else
    this node's address on ``FABRIC_IFNAME`` when that is set, else its Ray node address."""
    fabric = os.environ.get("FABRIC_IFNAME")
    return os.environ.get("VLLM_HOST_IP") or (address_of(fabric) if fabric else node_address())


def address_of(interface: str) -> str:
    """The IPv4 address of ``interface`` on this node."""
    import psutil

    for entry in psutil.net_if_addrs().get(interface, []):
        if entry.family == socket.AF_INET:
            return entry.address
    raise RuntimeError(
        f"FABRIC_IFNAME={interface}: this node has no IPv4 address on {interface}; set FABRIC_IFNAME to the "
        "interface of the network the nodes' collectives should use (slurm/site_env.sh), or unset it"
    )


def use_node_network() -> str:
    """Point gloo and vLLM at this process's address (:func:`own_address`); returns it."""
    address = own_address()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(address))
    os.environ.setdefault("VLLM_HOST_IP", address)
    return address


STORE_TIMEOUT = datetime.timedelta(seconds=300)


class Rendezvous:
    """A TCPStore served by this process (the driver) for one group's ranks, listening on its own
    address only (:func:`own_address`: the fabric's when there is one). The socket is bound here
    and handed to the store, whose own server would listen on every interface. ``url`` is what
    the ranks get, through Ray calls only: ``tcp://<secret>@host:port``, the group's secret
    (:func:`~nemo_dapo.sealed_store.new_secret`) with it, so it is never logged; ``address``
    (``host:port``) is what may be shown. :meth:`close` stops it."""

    def __init__(self) -> None:
        import torch.distributed as dist

        from nemo_dapo.sealed_store import new_secret

        address = own_address()
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((address, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        self._store: dist.TCPStore | None = dist.TCPStore(
            address, port, None, True, STORE_TIMEOUT, wait_for_workers=False, master_listen_fd=listener.fileno()
        )
        listener.detach()  # the store owns the socket now, and closes it with itself
        self.address = f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"
        self.url = f"tcp://{new_secret()}@{self.address}"

    def close(self) -> None:
        self._store = None


def join_store(rendezvous: str, world_size: int):
    """The store a rank meets its group at: a :class:`Rendezvous` URL, every key and value sealed
    with the group's secret (:class:`~nemo_dapo.sealed_store.SealedStore`), or the path of a
    FileStore for ranks of one machine started without a driver (tests, benches)."""
    import torch.distributed as dist

    if not rendezvous.startswith("tcp://"):
        return dist.FileStore(rendezvous, world_size)
    from nemo_dapo.sealed_store import SealedStore

    parts = urlsplit(rendezvous)
    if not parts.username or parts.hostname is None or parts.port is None:
        where = parts.netloc.rpartition("@")[2]  # never the secret
        raise ValueError(
            f"rendezvous {where!r}: not tcp://<secret>@host:port (a Rendezvous URL, with the group's secret)"
        )
    client = dist.TCPStore(parts.hostname, parts.port, world_size, False, STORE_TIMEOUT)
    return SealedStore(client, parts.username)


def join_group(rank: int, world_size: int, rendezvous: str, backend: str | None = None) -> None:
    """This rank's default process group, once: met at ``rendezvous`` (:func:`join_store`), the
    ranks connecting on this node's address (loopback locally, the fabric with ``FABRIC_IFNAME``).
    ``backend``: NCCL where CUDA is, gloo elsewhere, unless given."""
    import torch
    import torch.distributed as dist

    use_node_network()
    if dist.is_initialized():
        return
    from nemo_dapo.sealed_store import held_while

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = join_store(rendezvous, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    held_while(dist.group.WORLD, store)  # Megatron's groups are made through it too
