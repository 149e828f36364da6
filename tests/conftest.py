"""Shared test configuration.

Every async test runs on asyncio and on trio through anyio's pytest plugin (the ``anyio_backend`` fixture below
is parametrized); tests that embed aelastic in a plain asyncio program use pytest-asyncio in strict mode.

The suite runs on two pytest-xdist workers (``addopts``: most of its time is spent waiting for timeouts, keep-alives
and processes, not computing), a test file to a worker. A test that looks at the whole machine (every process's open
files, every file in ``/dev/shm``) is marked ``exclusive``: it runs while no other test does (:func:`_turn`).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# The suite runs the default install: asyncio on its own loop, also where the test extra installed uvloop (the
# ``fast`` extra), which aelastic would otherwise pick up in every launcher the tests start. The store's tests and
# a launch of their own run on uvloop too (``SERVER_BACKENDS``, tests/test_eventloop.py); ``AELASTIC_UVLOOP=1
# pytest`` runs every launcher on it.
os.environ.setdefault("AELASTIC_UVLOOP", "0")


@contextmanager
def _turn(exclusive: bool) -> Iterator[None]:
    """A readers-writer lock across the xdist workers of one run: every test holds it shared, an ``exclusive`` one
    alone. The gate makes it writer-preferring: an exclusive test waiting holds the gate, so no new test starts
    beside the one it waits for."""
    run = os.environ["PYTEST_XDIST_TESTRUNUID"]
    base = Path(tempfile.gettempdir()) / f"aelastic-tests-{run}"
    with open(f"{base}.gate", "a") as gate, open(f"{base}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # the lock is released when its file closes


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that hold a ``slow`` test (minutes long) go first, whole: xdist hands out files in this order, so the
    other worker runs the rest beside them instead of one worker running them alone at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: each file's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if "PYTEST_XDIST_TESTRUNUID" not in os.environ:  # one process: nothing runs beside a test
        yield
        return
    with _turn(item.get_closest_marker("exclusive") is not None):
        yield


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def etcd_endpoint() -> Iterator[str]:
    """One real etcd (aelastic's local etcd helper) for the session; each test keeps to a key prefix of its own.

    Raft timing allows 1 s leases, so liveness tests run at the seconds their settings ask for.
    """
    import anyio.from_thread

    from aelastic.etcd import RaftTiming, open_local_etcd

    etcd = open_local_etcd(timing=RaftTiming(heartbeat_interval=0.1, election_timeout=0.5))
    with anyio.from_thread.start_blocking_portal() as portal, portal.wrap_async_context_manager(etcd) as server:
        yield server.endpoint


@pytest.fixture
def etcd(etcd_endpoint: str) -> str:
    """The session's etcd for one test; each test module keeps to key prefixes of its own."""
    return etcd_endpoint
