"""How to reach an etcd cluster: its members' client URLs (:func:`parse_endpoints`), TLS files, credentials and the
per-member timeouts (:class:`EtcdConfig`)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from ..errors import ConfigurationError

__all__ = ["DEFAULT_PORT", "EtcdConfig", "parse_endpoints"]


DEFAULT_PORT: Final = 2379


def parse_endpoints(text: str, *, protocol: str = "http", default_port: int = DEFAULT_PORT) -> tuple[str, ...]:
    """``"h1:2379,https://h2"`` → ``("http://h1:2379", "https://h2:2379")``; ``protocol`` where none is given."""
    if protocol not in ("http", "https"):
        raise ConfigurationError(f"etcd protocol {protocol!r}: must be 'http' or 'https'")
    endpoints = []
    for raw in text.split(","):
        item = raw.strip().rstrip("/")
        if not item:
            continue
        url = item if "://" in item else f"{protocol}://{item}"
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise ConfigurationError(f"etcd endpoint {item!r}: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise ConfigurationError(f"etcd endpoint {item!r}: scheme must be http:// or https://")
        if not parts.hostname or parts.path or parts.query:
            raise ConfigurationError(f"etcd endpoint {item!r}: must be [http[s]://]HOST[:PORT]")
        endpoints.append(url if port is not None else f"{url}:{default_port}")
    if not endpoints:
        raise ConfigurationError(f"etcd endpoints {text!r}: need at least one HOST[:PORT]")
    return tuple(endpoints)


@dataclass(frozen=True, slots=True)
class EtcdConfig:
    """How to reach one etcd cluster: its members' client URLs, TLS files and credentials."""

    endpoints: tuple[str, ...]
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = None
    # Per member, so that a member that swallows packets fails over: a connect on a LAN takes well under a
    # millisecond, and 2 s still survives one lost SYN (Linux resends it after 1 s).
    connect_timeout: float = 2.0
    # Per member and unary call: etcd answers in milliseconds, or within about 5 s with an error of its own (no
    # leader, request timed out); a member silent for longer is failed over (a write: its outcome is unknown).
    request_timeout: float = 5.0
    # Per watch stream: None, or how long a stream may stay silent before its member counts as failed (watches then
    # ask for progress notifications, which the server must send more often: the job's own etcd does, each second).
    stream_timeout: float | None = None

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigurationError("etcd endpoints: need at least one")
        for endpoint in self.endpoints:
            if not endpoint.startswith(("http://", "https://")):
                raise ConfigurationError(f"etcd endpoint {endpoint!r}: must start with http:// or https://")
        if (self.cert is None) != (self.key is None):
            raise ConfigurationError("etcd TLS client certificate: give both cert and key, or neither")
        if (self.username is None) != (self.password is None):
            raise ConfigurationError("etcd authentication: give both username and password, or neither")
        for name in ("connect_timeout", "request_timeout", "stream_timeout"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigurationError(f"etcd {name}={getattr(self, name)!r}: must be > 0")

    def __repr__(self) -> str:  # never print the password
        return f"EtcdConfig({','.join(self.endpoints)!r}, tls={self.ca_cert is not None}, user={self.username!r})"

    def ssl_context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.ca_cert)
            if self.cert is not None:
                context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(
                f"etcd TLS files (cacert={self.ca_cert!r}, cert={self.cert!r}, key={self.key!r}): {exc}"
            ) from exc
        return context
