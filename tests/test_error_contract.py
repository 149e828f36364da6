"""Every public call raises the aelastic error that ended it, on asyncio and trio: never an ExceptionGroup where
one error happened (issue 14, item 1). ``pytest.raises(X)`` fails on a group holding an ``X``, so each test below
fails where the task groups inside a call leak their wrapping."""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Iterator

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

import anyio
import pytest

import aelastic
from aelastic._groups import single_error
from aelastic.errors import (
    EtcdConnectionError,
    EtcdError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
    StoreBindError,
    StoreConnectionError,
)
from aelastic.etcd import EtcdConfig, open_etcd_client, open_local_etcd, parse_endpoints
from aelastic.rendezvous import RendezvousParameters, open_rendezvous
from aelastic.store import open_store_client, open_store_server

DEADLINE = 60.0  # generous: a loaded 2-core machine


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port bound by this test and never listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another socket listens on: binding it again fails with EADDRINUSE."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# --- the helper --------------------------------------------------------------------------------------------------


def _fail() -> None:
    try:
        raise KeyError("context")
    except KeyError:
        raise RendezvousTimeoutError("late") from OSError("cause")


def _fail_in_nested_groups() -> None:
    try:
        _fail()
    except RendezvousTimeoutError as exc:
        raise ExceptionGroup("outer", [ExceptionGroup("inner", [exc])]) from None


def test_a_nested_group_of_one_error_becomes_that_error_with_its_chain_and_traceback() -> None:
    with pytest.raises(RendezvousTimeoutError) as caught, single_error():
        _fail_in_nested_groups()
    assert isinstance(caught.value.__cause__, OSError)
    assert isinstance(caught.value.__context__, KeyError)
    assert "_fail" in [entry.name for entry in caught.traceback]  # where it was raised, not only where re-raised


def test_several_errors_and_the_cancellation_class_stay_as_they_are() -> None:
    two = ExceptionGroup("two", [RendezvousTimeoutError("a"), RendezvousClosedError("b")])
    with pytest.raises(ExceptionGroup) as caught, single_error():
        raise two
    assert caught.value is two
    interrupt = BaseExceptionGroup("one", [KeyboardInterrupt()])
    with pytest.raises(BaseExceptionGroup) as caught_base, single_error():
        raise interrupt
    assert caught_base.value is interrupt


# --- open_rendezvous ---------------------------------------------------------------------------------------------

pytestmark = pytest.mark.anyio


async def test_join_timeout_through_open_rendezvous_is_the_timeout_error() -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:0", "lonely", 2, 2, join_timeout=1, last_call_timeout=0.5)
    with anyio.fail_after(DEADLINE), pytest.raises(RendezvousTimeoutError, match="join_timeout=1s"):
        async with open_rendezvous(params) as handler:
            await handler.next_rendezvous()


async def test_closed_rendezvous_through_open_rendezvous_is_the_closed_error() -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:0", "over", 1, 1)

    async def join_a_closed_rendezvous() -> None:
        async with open_rendezvous(params) as handler:
            await handler.set_closed()
            await handler.next_rendezvous()

    with anyio.fail_after(DEADLINE), pytest.raises(RendezvousClosedError, match="'over' is closed"):
        await join_a_closed_rendezvous()


async def test_an_error_of_the_body_comes_out_of_open_rendezvous_as_itself() -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:0", "body", 1, 1)

    async def fail_in_the_body() -> None:
        async with open_rendezvous(params) as handler:
            await handler.next_rendezvous()
            _ = 1 / 0

    with anyio.fail_after(DEADLINE), pytest.raises(ZeroDivisionError):
        await fail_in_the_body()


async def test_cancelling_the_body_of_open_rendezvous_is_only_a_cancellation() -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:0", "cancelled", 1, 1)
    with anyio.fail_after(DEADLINE):
        with anyio.CancelScope() as scope:
            async with open_rendezvous(params) as handler:
                await handler.next_rendezvous()
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught


async def test_an_unreachable_etcd_through_open_rendezvous_is_the_connection_error(refused_port: int) -> None:
    params = RendezvousParameters("etcd", f"127.0.0.1:{refused_port}", "nowhere", 1, 1, read_timeout=5)
    with anyio.fail_after(DEADLINE), pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{refused_port}"):
        async with open_rendezvous(params):
            pass


# --- launch and run ----------------------------------------------------------------------------------------------


def _config_that_times_out() -> aelastic.LaunchConfig:
    return aelastic.LaunchConfig(
        min_nodes=2, max_nodes=2, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"join_timeout": 1, "last_call_timeout": 0.5},
    )  # fmt: skip


async def test_launch_with_a_rendezvous_that_times_out_raises_the_timeout_error() -> None:
    with anyio.fail_after(DEADLINE), pytest.raises(RendezvousTimeoutError):
        await aelastic.launch(_config_that_times_out(), sys.executable, "-c", "pass")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_run_with_a_rendezvous_that_times_out_is_caught_by_except_timeout_error(backend: str) -> None:
    caught: RendezvousTimeoutError | None = None
    try:
        aelastic.run(_config_that_times_out(), sys.executable, "-c", "pass", backend=backend)
    except RendezvousTimeoutError as exc:  # the docstring's promise: no except* needed
        caught = exc
    assert caught is not None, "the rendezvous did not time out"
    assert "join_timeout=1s" in str(caught)


# --- store server and client -------------------------------------------------------------------------------------


async def test_store_server_bind_error_names_the_address(busy_port: int) -> None:
    with pytest.raises(StoreBindError, match=f"127.0.0.1:{busy_port}: .*in use") as caught:
        async with open_store_server("127.0.0.1", busy_port):
            pass
    assert caught.value.errno == errno.EADDRINUSE
    assert isinstance(caught.value, OSError)  # what it replaces, for callers that caught that


async def test_an_error_of_the_body_comes_out_of_open_store_server_as_itself() -> None:
    with pytest.raises(StoreConnectionError, match="from the body"):
        async with open_store_server("127.0.0.1", 0):
            raise StoreConnectionError("from the body")


async def test_store_client_connect_error_names_the_address(refused_port: int) -> None:
    with anyio.fail_after(DEADLINE):
        with pytest.raises(StoreConnectionError, match=f"127.0.0.1:{refused_port}"), anyio.fail_after(2):
            async with open_store_client("127.0.0.1", refused_port):
                pass


# --- etcd --------------------------------------------------------------------------------------------------------


async def test_etcd_client_of_an_unreachable_etcd_is_the_connection_error(refused_port: int) -> None:
    with anyio.fail_after(DEADLINE), pytest.raises(EtcdConnectionError, match=f"127.0.0.1:{refused_port}"):
        async with open_etcd_client(EtcdConfig(parse_endpoints(f"127.0.0.1:{refused_port}"))):
            pass


async def test_local_etcd_that_exits_before_ready_is_the_etcd_error() -> None:
    false = "/bin/false"  # an "etcd" that exits at once
    with anyio.fail_after(DEADLINE), pytest.raises(EtcdError, match="exited with 1 before it was ready"):
        async with open_local_etcd(binary=false):
            pass
