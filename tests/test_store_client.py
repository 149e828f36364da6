"""aelastic's async client against torch's own TCPStore server (libuv), every op, cross-checked by torch's client."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from datetime import timedelta

import anyio
import anyio.lowlevel
import pytest
import torch.distributed as dist

from aelastic.errors import QueueEmptyError, StoreConnectionError
from aelastic.store.client import StoreClient, open_store_client
from aelastic.store.server import open_store_server

pytestmark = pytest.mark.anyio


@pytest.fixture
def torch_server() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server
    del server


@pytest.fixture
async def client(torch_server: dist.TCPStore) -> AsyncIterator[StoreClient]:
    # The deadline bounds the connect only: around the yield it would cancel the test running inside it.
    async with AsyncExitStack() as stack:
        with anyio.fail_after(10):
            client = await stack.enter_async_context(open_store_client("127.0.0.1", torch_server.port))
        yield client


async def test_set_get_seen_by_torch(client: StoreClient, torch_server: dist.TCPStore) -> None:
    await client.set("alpha", b"1")
    await client.set("beta", "two")
    assert torch_server.get("alpha") == b"1"
    assert torch_server.get("beta") == b"two"
    torch_server.set("gamma", b"\x00\xff")
    assert await client.get("gamma") == b"\x00\xff"


async def test_add_is_decimal_and_shared(client: StoreClient, torch_server: dist.TCPStore) -> None:
    assert await client.add("counter", 5) == 5
    assert torch_server.add("counter", -2) == 3
    assert await client.add("counter", 0) == 3
    assert await client.get("counter") == b"3"


async def test_compare_set_rules(client: StoreClient) -> None:
    assert await client.compare_set("cas", "", "first") == b"first"  # missing + empty expected: written
    assert await client.compare_set("cas", "wrong", "second") == b"first"  # mismatch: current value
    assert await client.compare_set("cas", "first", "second") == b"second"  # match: written
    assert await client.compare_set("missing", "x", "y") == b"x"  # torch's documented lie
    assert not await client.check(["missing"])


async def test_check_delete_num_keys_list_keys(client: StoreClient, torch_server: dist.TCPStore) -> None:
    before = await client.num_keys()
    await client.multi_set(["k1", "k2"], [b"v1", b"v2"])
    assert await client.check(["k1", "k2"])
    assert not await client.check(["k1", "nope"])
    assert await client.num_keys() == before + 2
    assert {"k1", "k2"} <= set(await client.list_keys())
    assert set(torch_server.list_keys()) == set(await client.list_keys())
    assert await client.delete_key("k1")
    assert not await client.delete_key("k1")
    assert await client.multi_get(["k2"]) == [b"v2"]


async def test_append(client: StoreClient, torch_server: dist.TCPStore) -> None:
    await client.append("log", b"ab")
    await client.append("log", b"cd")
    assert torch_server.get("log") == b"abcd"


async def test_wait_woken_by_torch_client(client: StoreClient, torch_server: dist.TCPStore) -> None:
    other = dist.TCPStore("127.0.0.1", torch_server.port, is_master=False, timeout=timedelta(seconds=30))
    async with anyio.create_task_group() as tg:
        done = anyio.Event()

        async def waiter() -> None:
            await client.wait(["late"])
            done.set()

        tg.start_soon(waiter)
        await anyio.sleep(0.05)  # let the WAIT reach the server; correctness does not depend on it
        assert not done.is_set()
        await anyio.to_thread.run_sync(other.set, "late", b"x")
        with anyio.fail_after(10):
            await done.wait()


async def test_cancelled_wait_leaves_client_usable(client: StoreClient, torch_server: dist.TCPStore) -> None:
    with anyio.move_on_after(0.2) as scope:
        await client.get("never")
    assert scope.cancelled_caught
    # The command connection that carried the WAIT took it back with CANCEL_WAIT: it serves what follows.
    await client.set("after", b"ok")
    assert await client.get("after") == b"ok"
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.wait, ["woken"])
        await anyio.sleep(0.05)
        torch_server.set("woken", b"1")


async def test_concurrent_waits_do_not_block_commands(client: StoreClient) -> None:
    results: list[bytes] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(5):

                async def waiter(i: int = i) -> None:
                    results.append(await client.get(f"w{i}"))

                tg.start_soon(waiter)
            for i in range(5):
                await client.set(f"w{i}", str(i))
    assert sorted(results) == [b"0", b"1", b"2", b"3", b"4"]


async def test_a_wait_holds_the_command_connection_and_yields_it_to_commands(
    client: StoreClient, torch_server: dist.TCPStore
) -> None:
    """One connection per client: a WAIT waits on the command connection, and commands issued meanwhile preempt it
    (CANCEL_WAIT, the command, the WAIT again) instead of queueing behind it; the wait still ends when its key
    arrives, set by another client, and the connection is usable afterwards."""
    done = anyio.Event()

    async def waiter() -> None:
        await client.wait(["late"])
        done.set()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            for i in range(20):
                assert await client.add("beats", 1) == i + 1
                await client.set(f"k{i}", b"v")
                assert await client.compare_set(f"k{i}", b"v", b"w") == b"w"
            assert not done.is_set()
            await anyio.to_thread.run_sync(torch_server.set, "late", b"x")
            await done.wait()
        assert await client.get("late") == b"x"


async def test_a_preempted_wait_ends_whichever_comes_first(client: StoreClient, torch_server: dist.TCPStore) -> None:
    """A key that arrives around a preemption (set by the very command that preempts the wait, or by another
    client while the CANCEL_WAIT is on its way) still ends the wait: its WAIT, sent again, finds the key."""
    with anyio.fail_after(60):
        for i in range(40):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.wait, [f"race{i}"])
                for _ in range(i % 3):
                    await anyio.lowlevel.checkpoint()  # the WAIT sent or not yet, varied
                if i % 2:
                    await client.set(f"race{i}", b"by the preempting command")
                else:
                    tg.start_soon(anyio.to_thread.run_sync, torch_server.set, f"race{i}", b"by another client")
                    await client.add("beats", 1)
            # The task group ended: the wait returned.
        assert await client.add("beats", 0) == 20


async def test_one_connection_per_client_while_it_waits() -> None:
    async with (
        open_store_server("127.0.0.1", 0) as server,
        open_store_client("127.0.0.1", server.port) as client,
        open_store_client("127.0.0.1", server.port) as other,
    ):
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.wait, ["late"])
                await client.add("beat", 1)  # preempts the wait if it was sent already; it is sent again after
                while server.statistics().waiters != 1:  # noqa: ASYNC110 - server state has no event to wait on
                    await anyio.sleep(0.005)
                assert server.statistics().connections == 2  # the waiting client's one, and the other's
                await other.set("late", b"x")


async def test_queues(client: StoreClient, torch_server: dist.TCPStore) -> None:
    await client.queue_push("q", b"a")
    assert await client.queue_len("q") == 1  # same connection as the push: ordered
    torch_server.queue_push("q", b"b")
    assert torch_server.queue_len("q") == 2
    assert await client.queue_pop("q") == b"a"
    assert torch_server.queue_pop("q") == b"b"
    with pytest.raises(QueueEmptyError, match="'q' is empty"):
        await client.queue_pop("q", block=False)
    async with anyio.create_task_group() as tg:
        popped: list[bytes] = []

        async def popper() -> None:
            popped.append(await client.queue_pop("q"))

        tg.start_soon(popper)
        await anyio.sleep(0.05)
        await client.queue_push("q", b"c")
    assert popped == [b"c"]


async def test_barrier(client: StoreClient, torch_server: dist.TCPStore) -> None:
    async with open_store_client("127.0.0.1", torch_server.port) as second:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.barrier, "b", 2)
                tg.start_soon(second.barrier, "b", 2)


async def test_prefix_store_matches_torch(client: StoreClient, torch_server: dist.TCPStore) -> None:
    view = client.prefixed("job").prefixed("round1")
    await view.set("key", b"v")
    assert dist.PrefixStore("job/round1", torch_server).get("key") == b"v"
    assert await view.list_keys() == ["key"]
    assert await view.add("n", 2) == 2


async def test_ping(client: StoreClient) -> None:
    await client.ping()


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_connect_error_names_address() -> None:
    port = _unused_port()
    with anyio.fail_after(1), pytest.raises(StoreConnectionError, match=rf"127\.0\.0\.1:{port}"):
        await StoreClient("127.0.0.1", port).ping()


async def test_connect_retries_until_server_appears() -> None:
    port = _unused_port()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            connected = anyio.Event()

            async def connect() -> None:
                async with open_store_client("127.0.0.1", port) as c:
                    await c.set("x", b"1")
                    connected.set()

            tg.start_soon(connect)
            await anyio.sleep(0.3)
            assert not connected.is_set()
            server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
            await connected.wait()
    assert server.get("x") == b"1"
