"""Shared test configuration.

Every async test runs on asyncio and on trio through anyio's pytest plugin (the ``anyio_backend`` fixture below
is parametrized); tests that embed aelastic in a plain asyncio program use pytest-asyncio in strict mode.

Two tiers. Plain ``pytest`` (the README's command) runs the fast one: every feature's behaviour, with real processes,
in minutes. The full tier (``.ci/run``: ``pytest -m 'not torchrun_compare'``) adds the tests marked ``slow``: the
multi-host fault suite (``tests/faults``) and the Slurm cluster (``tests/slurm``), the many-fault and many-run jobs
(marked where they are defined), and the trio twin of each job of real workers in :data:`JOB_MODULES`, whose
asyncio twin runs in both tiers (the twins differ in the event loop under the agent, which the fast tier's store,
rendezvous and agent tests cover on both loops).
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


# The modules whose tests run whole jobs of real workers (agents, gloo, checkpoints), seconds each.
JOB_MODULES = frozenset({
    "test_agent_e2e", "test_agent_timers", "test_checkpoint", "test_cli_status", "test_etcd_backend",
    "test_etcd_embedded", "test_etcd_embedded_agents", "test_examples", "test_job_budget", "test_launch",
    "test_node_check", "test_observability", "test_prewarm", "test_rendezvous_disconnects", "test_rendezvous_processes",
    "test_rendezvous_store_loss", "test_restart", "test_signals", "test_unkillable",
})  # fmt: skip
_FULL_TIER_DIRS = ("faults", "slurm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        trio_twin = callspec is not None and callspec.params.get("anyio_backend") == "trio"
        if item.path.parent.name in _FULL_TIER_DIRS or (trio_twin and item.path.stem in JOB_MODULES):
            item.add_marker(pytest.mark.slow)


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
