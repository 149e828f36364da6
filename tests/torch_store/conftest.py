"""PyTorch's own store tests (``upstream/test_store.py``, unmodified) run against aelastic's store server.

``aelastic_store_shim.py`` serves every TCPStore *server* those tests start (``is_master=True``, however it is
reached) from an ``aelastic store`` process and hands the test torch's own C++ client connected to it; its
docstring says how, why a process, and what of torch's master is kept. The command's event loop is
``AELASTIC_ASYNC_BACKEND`` (default asyncio; ``trio``). Tests that never start a TCPStore server (FileStore,
HashStore, Python stores, torch's client against a fake server) run as they are and pass on both.

Every test that does not pass is in ``CLASSIFIED`` below, the one place that says why:

* ``a``: the test inspects torch's own server object or its master's constructor (repr, the wait for workers), not
  the server's behaviour on the wire; it says nothing about aelastic's server.
* ``b``: a difference of aelastic's server or command, deliberate or a limitation, said in the reason.
* ``c``: an aelastic defect, with its reproduction and the function at fault.

Entries with a regex are expected failures: the failure must match it (reported as XFAIL with the reason); a
failure that does not match fails, and so does a pass (XPASS(strict): the entry is stale). Entries without a regex
(kind a only) are skipped. A failure not listed here fails the run. ``test_store_classification.py`` fails on an entry
naming a test that upstream does not have.

The file of ``upstream/`` is PyTorch's and is not committed: ``upstream/README.md`` says how to fetch it. Without
it this folder's tests are skipped with that reason. ``TORCH_STORE_TARGET=torch`` runs it against torch's own
server (no shim, no classification): the baseline.

``libuvBackend``: torch's client reports the ``use_libuv`` it was constructed with, server or not, so upstream's
assertions on it hold for the clients the shim returns and say nothing about either server.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from helpers import classification

HERE = Path(__file__).parent
UPSTREAM = HERE / "upstream"
UPSTREAM_FILE = UPSTREAM / "test_store.py"
TARGET = os.environ.get("TORCH_STORE_TARGET", "aelastic")
CLASSIFY = TARGET == "aelastic"
TIMEOUT_S = 120  # per test; the slowest waits a few seconds for timeouts of its own

FETCHED = UPSTREAM_FILE.is_file()
MISSING = "PyTorch's store tests are not in tests/torch_store/upstream/: see its README.md to fetch them"
collect_ignore_glob = [] if FETCHED else ["upstream/*"]

REPR = (
    "asserts on repr() of torch's master object, 'server=TCPServer(port=N)' (torch's own server object); the shim's "
    "master is a client, 'server=<nullptr>'. (On a host whose /etc/hosts names ::ffff:127.0.0.1, as here, it fails "
    "against torch's own server too: 'addr=[ip4-mapped-loopback]' where it expects localhost.)"
)
BIND_MESSAGE = (
    "expects torch's bind error wording ('The server socket has failed to listen on any local network address'); "
    "the shim raises torch's DistNetworkError with aelastic store's own one line, which names the address and the "
    "cause. Same behaviour (refused, EADDRINUSE), other words"
)
BIND_MESSAGE_MATCH = (
    r'does not match "aelastic store: error: the store server cannot listen on \[::\]:\d+: Address already in use"'
)
LISTEN_FD = (
    "torch's master adopts a listening socket (master_listen_fd); the aelastic store command binds its own port and "
    "has no option to adopt one (in-process, open_store_server(sockets=...) serves sockets bound earlier)"
)
LISTEN_FD_MATCH = r"NotImplementedError: aelastic store shim: master_listen_fd=\d+"
WAIT_FOR_WORKERS = (
    "expects torch's master constructor to time out waiting for world_size=2 clients (TCPStore::waitForWorkers, a "
    "poll of the init/ key inside torch's master object, not a server behaviour); the shim's master is a client, "
    "which counts itself in and does not wait"
)
WAIT_FOR_WORKERS_MATCH = r"AssertionError: DistStoreError not raised"

# test id under upstream/ -> (kind, reason, regex the failure must match; None: skipped, kind a only)
CLASSIFIED: dict[str, tuple[str, str, str | None]] = {}
for _case in ("TCPStoreTest", "LibUvTCPStoreTest"):
    CLASSIFIED |= {
        f"test_store.py::{_case}::test_repr": ("a", REPR, None),
        f"test_store.py::{_case}::test_address_already_in_use": ("b", BIND_MESSAGE, BIND_MESSAGE_MATCH),
        f"test_store.py::{_case}::test_agent_store": (
            "b",
            BIND_MESSAGE + "; what follows (torch's master falling back to a client under "
            "TORCHELASTIC_USE_AGENT_STORE=1) is torch's master object, which the shim does not imitate",
            BIND_MESSAGE_MATCH,
        ),
        f"test_store.py::{_case}::test_take_over_listen_socket": ("b", LISTEN_FD, LISTEN_FD_MATCH),
        f"test_store.py::{_case}::test_store_timeout_on_missing_clients": (
            "a",
            WAIT_FOR_WORKERS,
            WAIT_FOR_WORKERS_MATCH,
        ),
    }


def pytest_configure(config: pytest.Config) -> None:
    if TARGET not in ("aelastic", "torch"):
        raise pytest.UsageError(f"TORCH_STORE_TARGET={TARGET!r}: must be aelastic or torch")


def pytest_report_header(config: pytest.Config) -> str:
    if TARGET == "torch":
        return "tests/torch_store: torch's own TCPStore server (TORCH_STORE_TARGET=torch)"
    return (
        "tests/torch_store: torch's servers replaced by 'aelastic store' on "
        f"{os.environ.get('AELASTIC_ASYNC_BACKEND', 'asyncio')}"
    )


def _shim() -> ModuleType:
    return classification.load_module(HERE / "aelastic_store_shim.py", "aelastic_store_shim")


def _is_upstream(path: Path) -> bool:
    return UPSTREAM in path.parents


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """Importing upstream's module starts servers (``TestMultiThreadedWait``'s class attributes): under the shim
    too. They run until the session ends."""
    if TARGET == "aelastic" and isinstance(collector, pytest.Module) and _is_upstream(collector.path):
        with _shim().patched():
            return (yield)
    return (yield)


@pytest.fixture(autouse=True)
def _aelastic_behind_torch(request: pytest.FixtureRequest) -> Iterator[None]:
    """For each upstream test only (the rest of the suite keeps torch's own server): torch's masters are served
    by aelastic, and the servers the test started are stopped when it ends. What upstream's tests leave in the
    environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) is undone afterwards, on both targets."""
    if not _is_upstream(request.node.path):
        yield
        return
    environ = dict(os.environ)
    try:
        if TARGET == "aelastic":
            shim = _shim()
            mark = shim.SERVERS.mark()
            try:
                with shim.patched():
                    yield
            finally:
                shim.SERVERS.stop_from(mark)
        else:
            yield
    finally:
        os.environ.clear()
        os.environ.update(environ)


def pytest_sessionfinish(session: pytest.Session) -> None:
    module = sys.modules.get("aelastic_store_shim")
    if module is not None:
        module.stop_all()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    module = sys.modules.get("aelastic_store_shim")
    if module is not None and module.SERVERS.started:
        terminalreporter.write_line(
            f"tests/torch_store: {module.SERVERS.started} 'aelastic store' processes served torch's masters "
            f"({os.environ.get('AELASTIC_ASYNC_BACKEND', 'asyncio')}), {len(module.SERVERS.running)} still running"
        )


pytest_collection_modifyitems, pytest_runtest_makereport = classification.hooks(
    "torch_store", UPSTREAM, TIMEOUT_S, CLASSIFIED if CLASSIFY else None
)
