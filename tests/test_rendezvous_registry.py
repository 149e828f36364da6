"""The registry of rendezvous backends: a --rdzv-conf key is checked by the backend that reads it (issue 23, 7b),
third-party backends register (and a name is refused once taken), and handlers report their own statistics."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from aelastic.errors import ConfigurationError
from aelastic.rendezvous import api as rendezvous_api
from aelastic.rendezvous import registry
from aelastic.rendezvous.api import JoinObserver, RendezvousHandler, RendezvousParameters, RendezvousStatistics
from aelastic.rendezvous.registry import check_parameters, lookup, open_rendezvous, register_backend
from aelastic.rendezvous.state import Action

# torch's launcher tests pass this (issue 23, 7b): c10d never reads `timeout`, so its value is not checked there.
TORCHRUN_CONF = {"join_timeout": "5", "last_call_timeout": "1", "timeout": "5'"}


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_entries", dict(registry._entries))  # this test's registrations stay its own
    monkeypatch.setattr(rendezvous_api, "_warned_keys", set())  # warned once per process: this test's own


@pytest.mark.parametrize("backend", ["c10d", "etcd", "etcd-v2"])
def test_a_key_the_backend_does_not_read_is_not_checked(backend: str, caplog: pytest.LogCaptureFixture) -> None:
    params = RendezvousParameters(backend, "localhost:29400", "job", 1, 1, **TORCHRUN_CONF)
    with caplog.at_level(logging.WARNING):
        check_parameters(params)
    assert "timeout" not in caplog.text  # torch's own key: neither refused nor warned about


def test_the_backend_that_reads_a_key_checks_it() -> None:
    with pytest.raises(ConfigurationError, match=r"--rdzv-conf timeout=\"5'\": must be a number of seconds"):
        check_parameters(RendezvousParameters("static", "localhost:29400", "job", 1, 1, rank=0, timeout="5'"))
    with pytest.raises(ConfigurationError, match="--rdzv-conf join_timeout='soon'"):
        check_parameters(RendezvousParameters("c10d", "localhost:29400", "job", 1, 1, join_timeout="soon"))


@pytest.mark.anyio
async def test_c10d_with_torchruns_conf_completes_a_round() -> None:
    params = RendezvousParameters("c10d", "localhost:0", "job", 1, 1, **TORCHRUN_CONF)
    with anyio.fail_after(30):
        async with open_rendezvous(params) as handler:
            info = await handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)


class _Handler(RendezvousHandler):
    """A third-party handler that keeps no statistics of its own."""

    def __init__(self, params: RendezvousParameters, observer: JoinObserver | None) -> None:
        self.params, self.observer = params, observer

    def get_backend(self) -> str:
        return self.params.backend

    def get_run_id(self) -> str:
        return self.params.run_id

    @property
    def use_agent_store(self) -> bool:
        return False

    async def next_rendezvous(self) -> rendezvous_api.RendezvousInfo:
        raise NotImplementedError

    async def num_nodes_waiting(self) -> int:
        return 0

    async def wait_for_membership_change(self, finished: rendezvous_api.Finished | None = None) -> str:
        raise NotImplementedError

    async def wait_for_member_ranks(self, known: frozenset[int]) -> frozenset[int]:
        raise NotImplementedError

    async def is_closed(self) -> bool:
        return False

    async def set_closed(self) -> None:
        pass

    async def shutdown(self) -> bool:
        return True


@asynccontextmanager
async def _open_third_party(
    params: RendezvousParameters, *, observer: JoinObserver | None = None
) -> AsyncIterator[RendezvousHandler]:
    yield _Handler(params, observer)


@pytest.mark.anyio
async def test_a_registered_backend_is_opened_with_the_observer_and_reports_empty_statistics() -> None:
    def observe(*step: object) -> None:
        pass

    register_backend("third-party", _open_third_party)
    register_backend("third-party", _open_third_party)  # the same opener again: nothing changes
    async with open_rendezvous(RendezvousParameters("third-party", "", "job", 1, 1), observer=observe) as handler:
        assert isinstance(handler, _Handler)
        assert handler.observer is observe
        assert handler.statistics() == RendezvousStatistics()
    assert lookup("third-party").open_reader is None


def test_a_taken_name_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="'c10d' is built in"):
        register_backend("c10d", _open_third_party)
    register_backend("third-party", _open_third_party)

    @asynccontextmanager
    async def other(params: RendezvousParameters, *, observer: JoinObserver | None = None) -> AsyncIterator[_Handler]:
        yield _Handler(params, observer)

    with pytest.raises(ConfigurationError, match="'third-party' is already registered"):
        register_backend("third-party", other)
    with pytest.raises(ConfigurationError, match="unknown rendezvous backend; known: c10d, etcd, etcd-v2, static"):
        lookup("no-such-backend")


@pytest.mark.anyio
async def test_a_c10d_handler_counts_its_own_work_and_names_the_stores_it_serves() -> None:
    steps: list[object] = []

    def observe(*step: object) -> None:
        steps.append(step[-1])

    params = RendezvousParameters("c10d", "localhost:0", "job", 1, 1)
    with anyio.fail_after(30):
        async with open_rendezvous(params, observer=observe) as a:
            opened = a.statistics()
            assert len(opened.stores) == 1  # the rendezvous store it hosts
            assert opened.join_requests == 0
            await a.next_rendezvous()
            done = a.statistics()
    assert len(done.stores) == 2  # and, as rank 0, the workers' store of the round
    assert done.join_requests == 1
    assert done.writes_won >= 1
    assert done.state_reads + done.digest_reads >= 1
    assert Action.FINISH in steps  # the observer saw the join's steps


@pytest.mark.anyio
async def test_two_handlers_of_one_process_count_apart() -> None:
    """The counters were process-global: now each handler has its own."""
    with anyio.fail_after(30):
        async with open_rendezvous(RendezvousParameters("c10d", "localhost:0", "one", 1, 1)) as a:
            await a.next_rendezvous()
            async with open_rendezvous(RendezvousParameters("c10d", "localhost:0", "two", 1, 1)) as b:
                assert b.statistics().join_requests == 0
                await b.next_rendezvous()
                assert (a.statistics().join_requests, b.statistics().join_requests) == (1, 1)


@pytest.mark.anyio
async def test_a_stopped_workers_store_leaves_the_handlers_statistics() -> None:
    """The agent's /metrics shows the stores a handler runs now: the previous round's workers' store, stopped when
    the next round completes, is no longer listed (what the metrics test checked of a process-global server set)."""
    with anyio.fail_after(60):
        async with open_rendezvous(RendezvousParameters("c10d", "localhost:0", "rounds", 1, 1)) as a:
            first = await a.next_rendezvous()
            ports = [store.port for store in a.statistics().stores]
            assert first.bootstrap_store_info.master_port in ports
            second = await a.next_rendezvous()
            ports = [store.port for store in a.statistics().stores]
    assert second.bootstrap_store_info.master_port != first.bootstrap_store_info.master_port
    assert second.bootstrap_store_info.master_port in ports
    assert first.bootstrap_store_info.master_port not in ports
    assert len(ports) == 2  # the rendezvous store it hosts, and the round's workers' store
