"""The job's own etcd as every node computes it: which hosts run its first members, their names and URLs. Pure.

``--rdzv-backend etcd --rdzv-endpoint embedded:HOST,HOST,...`` names the job's hosts, the same list on every node
(Slurm's nodelist fills it in for ``--rdzv-endpoint embedded``; Kubernetes' stable pod names are written in the
manifest). The first ``size`` hosts (3 by default) start the cluster's members; with fewer hosts the cluster is as
large as an odd count allows (2 hosts run one member: a second member would be a second node whose loss stops the
cluster, and tolerate nothing more). Every member listens on the job's two ports (``etcd_port``, client, and the
one after it, peers) and is named after its host, so the initial cluster (``name=peer URL``) and the client
endpoints are the same text on every node without any exchange.

A member that replaces a lost one (:mod:`.embedded`) runs on whichever node wins the claim, named after the
address it advertises; the list only seeds the first cluster and says where to look for members.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final

from .._net import format_address
from ..errors import ConfigurationError

__all__ = ["DEFAULT_CLIENT_PORT", "DEFAULT_SIZE", "EMBEDDED", "Layout", "is_address", "parse_embedded"]

EMBEDDED: Final = "embedded"
DEFAULT_CLIENT_PORT: Final = 2379  # etcd's own; the peer port is the one after it (etcd's 2380)
DEFAULT_SIZE: Final = 3  # survives one member's loss at a time; the cluster heals in between


def is_address(host: str) -> bool:
    """Whether ``host`` is an IP address literal (a member on it listens on that address alone)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_embedded(endpoint: str) -> tuple[str, ...] | None:
    """The hosts of an ``embedded[:HOST,HOST,...]`` endpoint (``()`` for ``embedded`` alone); ``None`` for any
    other endpoint. The hosts are names or addresses, without ports; each once.

    Raises:
        ConfigurationError: naming the endpoint and the rule it breaks.
    """
    keyword, sep, rest = endpoint.strip().partition(":")
    if keyword != EMBEDDED:
        return None
    if not sep:
        return ()
    hosts = tuple(h.strip() for h in rest.split(","))
    for host in hosts:
        if not host or "/" in host or (":" in host and not is_address(host)) or host.startswith("["):
            raise ConfigurationError(
                f"--rdzv-endpoint {endpoint!r}: must be embedded:HOST,HOST,... (names or addresses, no ports: "
                "the port is --rdzv-conf etcd_port)"
            )
    if len(set(hosts)) != len(hosts):
        raise ConfigurationError(f"--rdzv-endpoint {endpoint!r}: a host is listed twice")
    return hosts


@dataclass(frozen=True, slots=True)
class Layout:
    """The job's own etcd: its hosts (in the order every node lists them), ports, size and cluster token.

    ``size`` is the number of members the cluster keeps; ``members`` is what the hosts allow of it (an odd count).
    """

    hosts: tuple[str, ...]
    client_port: int = DEFAULT_CLIENT_PORT
    size: int = DEFAULT_SIZE
    token: str = "aelastic"

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ConfigurationError("the job's etcd needs at least one host")
        if not 1 <= self.client_port <= 65534:
            raise ConfigurationError(
                f"--rdzv-conf etcd_port={self.client_port}: must be 1..65534 (the peer port is the one after it)"
            )
        if self.size < 1 or self.size % 2 == 0:
            raise ConfigurationError(f"--rdzv-conf etcd_members={self.size}: must be odd and >= 1 (1, 3, 5, ...)")

    @property
    def peer_port(self) -> int:
        return self.client_port + 1

    @property
    def members(self) -> int:
        """How many members the cluster keeps: ``size``, or the largest odd count the hosts allow."""
        count = min(self.size, len(self.hosts))
        return count if count % 2 else count - 1

    @property
    def initial(self) -> tuple[str, ...]:
        """The hosts that start the first members."""
        return self.hosts[: self.members]

    def client_url(self, host: str) -> str:
        return f"http://{format_address(host, self.client_port)}"

    def peer_url(self, host: str) -> str:
        return f"http://{format_address(host, self.peer_port)}"

    def listen_host(self, host: str) -> str:
        """Where a member advertised as ``host`` listens: that address, or every IPv4 interface for a name (the
        name may resolve to an address the node does not hold, as Debian's 127.0.1.1)."""
        return host if is_address(host) else "0.0.0.0"

    def initial_cluster(self) -> str:
        """etcd's ``--initial-cluster`` of the first members: ``host=peer URL,...``."""
        return ",".join(f"{host}={self.peer_url(host)}" for host in self.initial)

    def endpoints(self) -> tuple[str, ...]:
        """Where a node looks for the cluster before it knows the members: the first members' client URLs, then
        the other hosts' (a member that replaced a lost one may run there)."""
        return tuple(self.client_url(host) for host in self.hosts)

    def tolerance(self, up: int, members: int) -> str:
        """What the cluster survives with ``up`` of its ``members`` members running, in words."""
        spare = up - (members // 2 + 1)
        if spare < 0:
            return "no quorum: every node's rendezvous stops until a lost member's node comes back"
        if spare == 0:
            return "the loss of one more member's node stops every node's rendezvous"
        if spare == 1:
            return "it survives the loss of one member's node"
        return f"it survives the loss of {spare} members' nodes at once"
