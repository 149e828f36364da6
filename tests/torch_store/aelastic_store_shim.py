"""Serve torch's TCPStore *servers* from ``aelastic store``, so that PyTorch's own store tests meet aelastic's server.

Wherever torch would start its own server, a ``TCPStore`` constructed with ``is_master=True`` (by the tests
directly, through ``torch.distributed.TCPStore`` or ``torch._C._distributed_c10d.TCPStore``, through
``create_tcp_store``, or through ``rendezvous``/``init_process_group``'s ``tcp://`` and ``env://``, which call the
same class by the name ``torch.distributed.rendezvous.TCPStore``), :class:`ServedTCPStore` starts
``python -m aelastic store --host :: --port PORT`` instead and returns torch's own C++ ``TCPStore`` *client*
(``is_master=False``, every other argument as given) connected to it. A ``TCPStore`` constructed as a client is
torch's, untouched. torch's client is the peer of every request: nothing of the protocol is imitated here.

Why a process, not the server in a thread of the test's process: some of torch's Store bindings (the queue
operations, ``queue_pop`` above all) hold the GIL while they block on the socket, so a server on an event loop in
the same interpreter could never answer them (``tests/helpers/torch_store_peer.py`` meets the same limit). And the
issue asks for ``aelastic store``, the command, which this runs as a user would.

What is kept of torch's master, and what is not:

* where it listens: torch's server listens on every interface at ``port`` whatever ``host_name`` says (the host
  is where the client connects), so the aelastic store listens on ``::`` (dual stack); port 0 is the kernel's
  choice, read from the command's ``aelastic store listening on [::]:PORT`` line, and is what the returned
  client's ``port`` says;
* ``multi_tenant=True``: torch reuses the server this process already runs on that port (when it was started
  multi-tenant too); so does this, with its aelastic store;
* a bind failure raises torch's ``DistNetworkError`` (what torch's constructor raises) with the command's own
  one-line message (aelastic's wording, not torch's);
* ``master_listen_fd`` (a listening socket to adopt) is refused with ``NotImplementedError``: the command binds its
  own port (the library can serve bound sockets, ``open_store_server(sockets=...)``);
* torch's master constructor, with ``wait_for_workers`` and a ``world_size``, then waits for ``world_size``
  clients to count themselves in (a client-side poll of the ``init/`` key inside torch's master object); the
  client returned here counts itself in as torch's clients do, and does not wait.

Lifetime: torch's server lives as long as the C++ ``TCPStore`` object, which Python cannot see (a Python wrapper
dies while a ``PrefixStore`` or a process group still holds the C++ store). So a server started during a test is
stopped when that test ends (``Servers.stop_from``), and one started outside any test (at import: upstream's
``TestMultiThreadedWait`` makes two as class attributes) when the session ends. Stopping is SIGTERM (the command
exits 0), then SIGKILL after 10 s; every process is reaped.

The event loop of the command is its default (asyncio) or ``AELASTIC_ASYNC_BACKEND`` (``trio``), inherited.
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO, Any

import torch._C._distributed_c10d as _c10d
from torch.distributed import DistNetworkError

TORCH_TCPSTORE: Any = _c10d.TCPStore
LISTENING = "aelastic store listening on "
START_DEADLINE_S = 60.0  # a busy 2-CPU machine starts the command in well under a second
STOP_GRACE_S = 10.0


@dataclass
class StoreProcess:
    """One running ``aelastic store``."""

    port: int
    multi_tenant: bool
    process: subprocess.Popen[bytes]
    stderr: IO[bytes] = field(repr=False)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after the grace; always reaped."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()
        self.stderr.close()


class Servers:
    """The aelastic stores started in place of torch's servers, in the order they were started."""

    def __init__(self) -> None:
        self.running: list[StoreProcess] = []
        self.started = 0  # ever, for the report

    def mark(self) -> int:
        return len(self.running)

    def stop_from(self, mark: int) -> None:
        """Stop every server started since ``mark`` (a test's own), newest first."""
        for server in reversed(self.running[mark:]):
            server.stop()
        del self.running[mark:]

    def start(self, port: int, *, multi_tenant: bool) -> StoreProcess:
        if multi_tenant and port != 0:
            for server in self.running:
                if server.multi_tenant and server.port == port and server.process.poll() is None:
                    return server
        # A file, not a pipe: nobody reads it while the server runs. StoreProcess.stop closes it.
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 - open for the server's life
        process = subprocess.Popen(
            [sys.executable, "-m", "aelastic", "store", "--host", "::", "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], START_DEADLINE_S)
        line = process.stdout.readline().decode() if ready else ""
        if not line.startswith(LISTENING):
            if ready:  # it printed nothing: it is exiting with its error
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(STOP_GRACE_S)
            message = _last_line(_read(stderr))
            StoreProcess(port, multi_tenant, process, stderr).stop()
            raise DistNetworkError(message or f"aelastic store did not start on port {port}: {line!r}")
        server = StoreProcess(int(line.strip().rsplit(":", 1)[1]), multi_tenant, process, stderr)
        self.running.append(server)
        self.started += 1
        return server


def _read(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


SERVERS = Servers()


def construct(
    host_name: str,
    port: int,
    world_size: int | None = None,
    is_master: bool = False,
    timeout: timedelta = timedelta(seconds=300),  # torch's default, as its binding states it
    wait_for_workers: bool = True,
    multi_tenant: bool = False,
    master_listen_fd: int | None = None,
    use_libuv: bool = True,
) -> Any:
    """``torch.distributed.TCPStore(...)`` with torch's parameters: a master is served by ``aelastic store``."""
    if not is_master:
        return TORCH_TCPSTORE(
            host_name, port, world_size, False, timeout, wait_for_workers, multi_tenant, master_listen_fd, use_libuv
        )
    if master_listen_fd is not None:
        raise NotImplementedError(
            f"aelastic store shim: master_listen_fd={master_listen_fd}: the aelastic store command binds its own "
            "port and cannot adopt a listening socket"
        )
    server = SERVERS.start(port, multi_tenant=multi_tenant)
    return TORCH_TCPSTORE(host_name, server.port, world_size, False, timeout, wait_for_workers, False, None, use_libuv)


class _ServedTCPStoreType(type):
    """Calling the class constructs through :func:`construct`; ``isinstance``/``issubclass`` answer as torch's
    ``TCPStore`` would (what the shim returns, and what torch's own code hands back, are torch's objects)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return construct(*args, **kwargs)

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, TORCH_TCPSTORE)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, TORCH_TCPSTORE)


class ServedTCPStore(metaclass=_ServedTCPStoreType):
    """Stands for torch's ``TCPStore`` class wherever torch's modules name it (:func:`patched`)."""


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Every ``TCPStore`` name of a loaded torch module is :class:`ServedTCPStore` inside the block. On leaving,
    every module name that is :class:`ServedTCPStore` (also of a module imported inside the block, with
    ``from torch.distributed import TCPStore``) is torch's class again, so nothing outside sees the shim."""
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("torch") and getattr(module, "TCPStore", None) is TORCH_TCPSTORE:
            module.TCPStore = ServedTCPStore
    try:
        yield
    finally:
        for module in list(sys.modules.values()):
            if getattr(module, "TCPStore", None) is ServedTCPStore:
                module.TCPStore = TORCH_TCPSTORE


def stop_all() -> None:
    SERVERS.stop_from(0)


__all__ = ["SERVERS", "TORCH_TCPSTORE", "ServedTCPStore", "construct", "patched", "stop_all"]
