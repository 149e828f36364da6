"""Addresses: parsing ``host[:port]`` endpoints, printing them, and telling whether a host is this machine.

Never reverse-resolve an IP address the user gave; a hostname is resolved only to decide whether it names this
machine.
"""

from __future__ import annotations

import ipaddress
import socket

from .errors import ConfigurationError

__all__ = ["format_address", "is_local_host", "parse_endpoint"]


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoint(endpoint: str, default_port: int | None, *, what: str = "--rdzv-endpoint") -> tuple[str, int]:
    """Split ``host[:port]`` (``[v6]:port`` or a bare IPv6 literal) into host and port."""
    text = endpoint.strip()
    if not text:
        raise ConfigurationError(f"{what} '': must be HOST[:PORT]")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigurationError(f"{what} {endpoint!r}: an IPv6 address must be written [ADDR] or [ADDR]:PORT")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:  # a bare IPv6 literal, no port
        host, port_text = text, None
    else:
        host, _, port_text = text.partition(":")
        port_text = port_text if ":" in text else None
    if not host:
        raise ConfigurationError(f"{what} {endpoint!r}: the host is empty")
    if port_text is None:
        if default_port is None:
            raise ConfigurationError(f"{what} {endpoint!r}: needs a port (HOST:PORT)")
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigurationError(f"{what} {endpoint!r}: port {port_text!r} is not an integer 0..65535")
    return host, int(port_text)


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine: loopback, this host's name, or an address bound to an interface.

    An address is local exactly when a socket can bind to it, which is what is tested.
    """
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        if ipaddress.ip_address(address.split("%")[0]).is_loopback:
            return True
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0, *sockaddr[2:]) if family == socket.AF_INET6 else (address, 0))
            except OSError:
                continue
            return True
    return host == socket.getfqdn()  # last: a reverse DNS lookup, slow where DNS is
