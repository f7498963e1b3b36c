"""The address a worker's own connections use, chosen on the node it runs on.

gloo (the training ranks' process groups; Megatron creates gloo groups even beside NCCL) and
vLLM's tensor-parallel ranks listen on one interface each. A worker takes the one that carries
its Ray node's address: on a local run (Ray on 127.0.0.1) that is loopback, on a cluster the
node's own address, which the other nodes reach. Settings already in the environment
(``GLOO_SOCKET_IFNAME``, ``VLLM_HOST_IP``, e.g. an InfiniBand interface set by the site) win.
"""

from __future__ import annotations

import ipaddress
import os

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


def use_node_network() -> str:
    """Point gloo and vLLM at this node's address (module doc); returns the address."""
    address = os.environ.get("VLLM_HOST_IP") or node_address()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(address))
    os.environ.setdefault("VLLM_HOST_IP", address)
    return address
