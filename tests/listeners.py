"""Which sockets this test process and its descendants listen on (the network rule: loopback only)."""

import ipaddress
import os

import psutil


def descendant_pids() -> set[int]:
    me = psutil.Process(os.getpid())
    return {me.pid} | {child.pid for child in me.children(recursive=True)}


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is IPv4 loopback seen from IPv6
    return (mapped or address).is_loopback


def our_listeners() -> list[tuple[str, str]]:
    """(address, 'pid name:port') of every listening socket of this test process and its descendants."""
    ours = descendant_pids()
    return [
        (conn.laddr.ip, f"pid {conn.pid} ({psutil.Process(conn.pid).name()}) port {conn.laddr.port}")
        for conn in psutil.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN and conn.pid in ours
    ]
