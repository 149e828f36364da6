"""Which host of the job's etcd's layout this node is (:mod:`.embedded`, step 1 of its module docstring): by name,
else by the addresses the hosts resolve to."""

from __future__ import annotations

import os
import socket

import anyio

from .layout import Layout, is_address

__all__ = ["identify"]


def _holds(address: str) -> bool:
    """Whether this node holds ``address`` (a socket can bind to it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


async def identify(layout: Layout, local_addr: str | None) -> str | None:
    """The host of ``layout`` that names this node, or ``None``; see the module docstring (step 1)."""
    hostname = socket.gethostname()
    names = {n for n in (local_addr, os.environ.get("SLURMD_NODENAME"), hostname, hostname.split(".")[0]) if n}
    for host in layout.hosts:
        if host in names or (not is_address(host) and host.split(".")[0] in names):
            return host
    for host in layout.hosts:
        try:
            infos = await anyio.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            continue  # not resolvable (yet): a peer that has not started
        addresses = {str(info[4][0]) for info in infos}
        if local_addr is not None:
            if local_addr in addresses:
                return host
        elif any(not _loopback(a) and _holds(a) for a in addresses):
            return host
        elif len(layout.hosts) == 1 and all(_loopback(a) for a in addresses):
            return host  # a job on this machine alone (embedded:localhost): every node holds the loopback
    return None


def _loopback(address: str) -> bool:
    """Every node holds a loopback address (Debian names the host 127.0.1.1): it tells no node from another."""
    return address.startswith("127.") or address == "::1"
