"""``EtcdStore``: every torch ``Store`` operation over a real etcd, on asyncio and trio; etcd3-py reads back."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.from_thread
import pytest
from helpers.etcd import reader

from aelastic.errors import QueueEmptyError, StoreError
from aelastic.etcd import EtcdConfig, EtcdStore, open_etcd_client, parse_endpoints

pytestmark = pytest.mark.anyio

_prefixes = itertools.count()


@asynccontextmanager
async def stores(endpoint: str, n: int = 1) -> AsyncIterator[list[EtcdStore]]:
    """``n`` stores on separate clients (separate connections), sharing one fresh prefix."""
    prefix = f"/test/store{next(_prefixes)}"
    async with (
        open_etcd_client(EtcdConfig(parse_endpoints(endpoint))) as a,
        open_etcd_client(EtcdConfig(parse_endpoints(endpoint))) as b,
    ):
        yield [EtcdStore(a if i % 2 == 0 else b, prefix) for i in range(n)]


async def test_set_get_check_delete(etcd: str) -> None:
    async with stores(etcd) as (s,):
        await s.set("k", "v")
        assert await s.get("k") == b"v"
        assert reader(etcd).range(f"{s.prefix}/kv/k").kvs[0].value == b"v"
        assert await s.check(["k"])
        assert not await s.check(["k", "missing"])
        assert await s.delete_key("k")
        assert not await s.delete_key("k")
        assert not reader(etcd).range(f"{s.prefix}/kv/k").kvs


async def test_get_and_wait_are_woken_by_another_client(etcd: str) -> None:
    async with stores(etcd, 2) as (s, other):
        got: list[bytes] = []
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def getter() -> None:
                    got.append(await s.get("late"))

                async def waiter() -> None:
                    await s.wait(["late", "later"])
                    got.append(b"waited")

                tg.start_soon(getter)
                tg.start_soon(waiter)
                await other.set("late", b"1")
                await other.set("later", b"2")
        assert sorted(got) == [b"1", b"waited"]


async def test_cancelled_get(etcd: str) -> None:
    async with stores(etcd) as (s,):
        with anyio.move_on_after(0.2) as scope:
            await s.get("never")
        assert scope.cancelled_caught
        await s.set("still", "works")


async def test_add_is_atomic_across_clients(etcd: str) -> None:
    async with stores(etcd, 4) as ss:
        assert await ss[0].add("n", 5) == 5
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for s in ss:
                    for _ in range(5):
                        tg.start_soon(s.add, "n", 1)
        assert await ss[0].get("n") == b"25"
        assert reader(etcd).range(f"{ss[0].prefix}/kv/n").kvs[0].value == b"25"
        await ss[0].set("text", "abc")
        with pytest.raises(StoreError):
            await ss[0].add("text", 1)


async def test_compare_set_torch_semantics(etcd: str) -> None:
    async with stores(etcd) as (s,):
        assert await s.compare_set("c", "x", "y") == b"x"  # missing key, non-empty expected: the lie, no write
        assert not await s.check(["c"])
        assert await s.compare_set("c", "", "a") == b"a"
        assert await s.compare_set("c", "zz", "b") == b"a"
        assert await s.compare_set("c", "a", "b") == b"b"
        assert await s.get("c") == b"b"


async def test_append_multi_and_list(etcd: str) -> None:
    async with stores(etcd) as (s,):
        await s.append("ap", "ab")
        await s.append("ap", b"cd")
        assert await s.get("ap") == b"abcd"
        await s.multi_set(["m1", "m2"], ["1", b"2"])
        assert await s.multi_get(["m1", "m2", "ap"]) == [b"1", b"2", b"abcd"]
        with pytest.raises(StoreError):
            await s.multi_set(["a"], [])
        await s.queue_push("q", "x")
        assert sorted(await s.list_keys()) == ["ap", "m1", "m2", "q"]
        assert await s.num_keys() == 4
        view = s.prefixed("v")
        await view.set("inner", "1")
        assert await view.list_keys() == ["inner"]


async def test_queues_fifo_blocking_and_exclusive(etcd: str) -> None:
    async with stores(etcd, 2) as (s, other):
        with pytest.raises(QueueEmptyError):
            await s.queue_pop("q", block=False)
        for item in ("a", "b", "c"):
            await s.queue_push("q", item)
        await s.queue_push("q/sub", "not mine")
        assert await s.queue_len("q") == 3
        assert await s.queue_pop("q") == b"a"
        popped: list[bytes] = []
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for store in (s, other, s):
                    tg.start_soon(_pop_into, store, popped)
                await other.queue_push("q", "d")
        assert sorted(popped) == [b"b", b"c", b"d"]  # each element popped exactly once
        assert await s.queue_len("q") == 0
        assert await s.queue_len("q/sub") == 1


async def _pop_into(store: EtcdStore, out: list[bytes]) -> None:
    out.append(await store.queue_pop("q"))


async def test_barrier_releases_all_and_is_reusable(etcd: str) -> None:
    async with stores(etcd, 3) as ss:
        for _ in range(2):
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for s in ss:
                        tg.start_soon(s.barrier, "b", 3)
        assert await ss[0].get("b") == b"6"
