"""Reading etcd's keys the way an independent client would (etcd3-py's synchronous client), to check what
aelastic wrote."""

from __future__ import annotations

from urllib.parse import urlsplit

import requests
from etcd3 import Client as Etcd3Client  # type: ignore[import-untyped]
from semantic_version import Version  # type: ignore[import-untyped]


class _Client(Etcd3Client):  # type: ignore[misc]
    """etcd3-py's client asks the server's version with a 0.3 s timeout and, when a busy machine answers later,
    fails with an ``AttributeError`` in its constructor: here the question waits as long as the tests' deadlines."""

    def _retrieve_version(self) -> None:
        answer = requests.get(self._url("/version", prefix=False), timeout=60)
        answer.raise_for_status()
        self.server_version = answer.json()["etcdserver"]
        self.cluster_version = answer.json()["etcdcluster"]
        self.server_version_sem = Version(self.server_version)
        self.cluster_version_sem = Version(self.cluster_version)


def client(host: str, port: int) -> Etcd3Client:
    """A synchronous client of the etcd at ``host``:``port``."""
    return _Client(host, port)


def reader(endpoint: str) -> Etcd3Client:
    """A client of the first member of ``endpoint`` (a comma-separated list of URLs)."""
    parts = urlsplit(endpoint.split(",")[0])
    assert parts.hostname is not None, endpoint
    assert parts.port is not None, endpoint
    return client(parts.hostname, parts.port)


def job_etcd_left_behind(run_id: str, endpoints: list[tuple[str, int]], member: str = "") -> list[str]:
    """What a job's own etcd (``--rdzv-endpoint embedded``, run ``run_id``) left on this machine: a guard or etcd
    process (their command lines name the member's data directory), a data directory, or one of ``endpoints``
    (host, port) that no server could listen on. ``member``: of that member alone."""
    import tempfile
    from pathlib import Path

    from helpers.procs import alive, listenable

    def command(path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError:  # gone meanwhile
            return b""

    marker = f"aelastic-etcd-{run_id}-{member + '-' if member else ''}".encode()
    commands = {int(p.parent.name): command(p) for p in Path("/proc").glob("[0-9]*/cmdline")}
    found = [f"process {pid}: {c[:120]!r}" for pid, c in commands.items() if marker in c and alive(pid)]
    found += [str(p) for root in ("/dev/shm", tempfile.gettempdir()) for p in Path(root).glob(f"{marker.decode()}*")]
    found += [f"{host}:{port}" for host, port in endpoints if not listenable(host, port)]
    return found
