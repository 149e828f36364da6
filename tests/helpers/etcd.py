"""Reading etcd's keys the way an independent client would (etcd3-py's synchronous client), to check what
aelastic wrote."""

from __future__ import annotations

from urllib.parse import urlsplit

from etcd3 import Client as Etcd3Client  # type: ignore[import-untyped]


def reader(endpoint: str) -> Etcd3Client:
    """A client of the first member of ``endpoint`` (a comma-separated list of URLs)."""
    parts = urlsplit(endpoint.split(",")[0])
    return Etcd3Client(parts.hostname, parts.port)
