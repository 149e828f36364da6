"""Shared test configuration.

Every async test runs on asyncio and on trio through anyio's pytest plugin (the ``anyio_backend`` fixture below
is parametrized); tests that embed aelastic in a plain asyncio program use pytest-asyncio in strict mode.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# The suite runs the default install: asyncio on its own loop, also where the test extra installed uvloop (the
# ``fast`` extra), which aelastic would otherwise pick up in every launcher the tests start. The store's tests and
# a launch of their own run on uvloop too (``SERVER_BACKENDS``, tests/test_eventloop.py); ``AELASTIC_UVLOOP=1
# pytest`` runs every launcher on it.
os.environ.setdefault("AELASTIC_UVLOOP", "0")


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
