"""A hypothesis state machine drives our client against our server, every Store operation, and checks each
answer against a model of torch's semantics (a dict of values and a dict of queues). Operations that must block
(GET/WAIT of a missing key, a blocking pop of an empty queue) are given a short deadline, so the cancelled-wait
path (CANCEL_WAIT) runs constantly; a failed ADD (non-numeric value) closes the command connection, which the
client must reopen. After every step no wait is left registered and the connections stay few.

Hypothesis drives plain functions, so the event loop (asyncio or trio) runs in a blocking portal.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from aelastic.errors import QueueEmptyError, StoreConnectionError
from aelastic.store.client import StoreClient, open_store_client
from aelastic.store.server import StoreServer, open_store_server

T = TypeVar("T")

KEYS = st.sampled_from(["a", "b", "c", "n"])
# Queues get keys of their own: a key that is a value *and* a queue is a corner torch's semantics leave odd (a
# blocking pop of its empty queue returns from WAIT at once, since the value makes the key present).
QUEUES = st.sampled_from(["q", "r"])
ANY_KEYS = st.lists(st.one_of(KEYS, QUEUES), min_size=1, max_size=3)
VALUES = st.one_of(
    st.integers(-1000, 1000).map(lambda i: str(i).encode()),
    st.sampled_from([b"", b"x", b"\x00\xff", b"hello"]),
)
BLOCKED = 0.05  # seconds an operation that must block is given before it is cancelled
UNBLOCKED = 10.0  # seconds an operation that must not block is given before the test fails
MAX_CONNECTIONS = 1 + 4 + 1  # the command connection, the idle wait pool, one wait in flight


class StoreModel(RuleBasedStateMachine):
    portal: anyio.from_thread.BlockingPortal  # set by the test, per backend

    def __init__(self) -> None:
        super().__init__()
        self.table: dict[str, bytes] = {}
        self.queues: dict[str, deque[bytes]] = {}
        self._server_cm = self.portal.wrap_async_context_manager(open_store_server("127.0.0.1", 0))
        self.server: StoreServer = self._server_cm.__enter__()
        self._client_cm = self.portal.wrap_async_context_manager(open_store_client("127.0.0.1", self.server.port))
        self.client: StoreClient = self._client_cm.__enter__()

    def teardown(self) -> None:
        self._client_cm.__exit__(None, None, None)
        assert self.portal.call(self._wait_for_no_connections)
        self._server_cm.__exit__(None, None, None)

    async def _wait_for_no_connections(self) -> bool:
        with anyio.move_on_after(10):
            while self.server.statistics().connections:  # noqa: ASYNC110 - server state has no event
                await anyio.sleep(0.005)
            return True
        return False

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``fn(*args)``, which must not block: a generous deadline turns a wrong model into a failure, not a hang."""

        async def bounded() -> T:
            with anyio.fail_after(UNBLOCKED):
                return await fn(*args)

        return self.portal.call(bounded)

    def blocks(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Whether ``fn(*args)`` was still waiting when its deadline cancelled it."""

        async def bounded() -> bool:
            with anyio.move_on_after(BLOCKED) as scope:
                await fn(*args)
            return scope.cancelled_caught

        return self.portal.call(bounded)

    def present(self, key: str) -> bool:
        return key in self.table or bool(self.queues.get(key))

    def counter(self, key: str) -> int | None:
        """The value ``key`` counts from for ADD/BARRIER, or None if it is not a decimal integer."""
        value = self.table.get(key, b"0")
        return int(value) if value.lstrip(b"-").isdigit() and value.count(b"-") <= 1 else None

    # --- rules ----------------------------------------------------------------------------------------------------

    @rule(key=KEYS, value=VALUES)
    def set_value(self, key: str, value: bytes) -> None:
        self.call(self.client.set, key, value)
        self.table[key] = value

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        if key in self.table:
            assert self.call(self.client.get, key) == self.table[key]
        else:
            assert self.blocks(self.client.get, key)

    @rule(keys=ANY_KEYS)
    def wait(self, keys: list[str]) -> None:
        assert self.blocks(self.client.wait, keys) is not all(self.present(k) for k in keys)

    @rule(keys=ANY_KEYS)
    def check(self, keys: list[str]) -> None:
        assert self.call(self.client.check, keys) is all(self.present(k) for k in keys)

    @rule(key=KEYS, amount=st.integers(-100, 100))
    def add(self, key: str, amount: int) -> None:
        current = self.counter(key)
        if current is None:  # the server closes the connection of a bad ADD; the client reconnects next time
            with pytest.raises(StoreConnectionError, match="lost the connection"):
                self.call(self.client.add, key, amount)
            return
        assert self.call(self.client.add, key, amount) == current + amount
        self.table[key] = str(current + amount).encode()

    @rule(key=KEYS)
    def barrier_of_one(self, key: str) -> None:
        current = self.counter(key)
        if current is None:
            with pytest.raises(StoreConnectionError, match="lost the connection"):
                self.call(self.client.barrier, key, 1)
            return
        # torch's BARRIER releases once the counter reaches world_size: from a negative counter (ADD made it so)
        # a barrier of one waits, and its cancellation (CANCEL_WAIT) keeps the increment.
        if current + 1 >= 1:
            self.call(self.client.barrier, key, 1)
        else:
            assert self.blocks(self.client.barrier, key, 1)
        self.table[key] = str(current + 1).encode()

    @rule(key=KEYS, expected=VALUES, desired=VALUES)
    def compare_set(self, key: str, expected: bytes, desired: bytes) -> None:
        current = self.table.get(key)
        if current is None:
            want = expected or desired  # torch: a missing key with a non-empty expected "lies"
            if not expected:
                self.table[key] = desired
        elif current == expected:
            want = self.table[key] = desired
        else:
            want = current
        assert self.call(self.client.compare_set, key, expected, desired) == want

    @rule(key=KEYS)
    def delete_key(self, key: str) -> None:
        assert self.call(self.client.delete_key, key) is (self.table.pop(key, None) is not None)

    @rule(key=KEYS, value=VALUES)
    def append(self, key: str, value: bytes) -> None:
        self.call(self.client.append, key, value)
        self.table[key] = self.table.get(key, b"") + value

    @rule(items=st.dictionaries(KEYS, VALUES, min_size=1, max_size=3))
    def multi_set(self, items: dict[str, bytes]) -> None:
        self.call(self.client.multi_set, list(items), list(items.values()))
        self.table.update(items)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=3))
    def multi_get(self, keys: list[str]) -> None:
        if all(k in self.table for k in keys):
            assert self.call(self.client.multi_get, keys) == [self.table[k] for k in keys]
        else:
            assert self.blocks(self.client.multi_get, keys)

    @rule()
    def num_keys_and_list_keys(self) -> None:
        assert self.call(self.client.num_keys) == len(self.table)
        assert sorted(self.call(self.client.list_keys)) == sorted(self.table)

    @rule(key=QUEUES, value=VALUES)
    def queue_push(self, key: str, value: bytes) -> None:
        self.call(self.client.queue_push, key, value)
        self.queues.setdefault(key, deque()).append(value)

    @rule(key=QUEUES, block=st.booleans())
    def queue_pop(self, key: str, block: bool) -> None:
        queue = self.queues.get(key)
        if queue:
            assert self.call(lambda: self.client.queue_pop(key, block=block)) == queue.popleft()
        elif block:
            assert self.blocks(self.client.queue_pop, key)
        else:
            with pytest.raises(QueueEmptyError):
                self.call(lambda: self.client.queue_pop(key, block=False))

    @rule(key=QUEUES)
    def queue_len(self, key: str) -> None:
        assert self.call(self.client.queue_len, key) == len(self.queues.get(key, ()))

    @rule()
    def ping(self) -> None:
        self.call(self.client.ping)

    # --- invariants -----------------------------------------------------------------------------------------------

    @invariant()
    def nothing_left_waiting(self) -> None:
        self.call(self.client.ping)  # a round trip: the server has handled every reply-less SET sent before
        stats = self.server.statistics()
        assert stats.waiters == 0  # every cancelled wait was withdrawn (CANCEL_WAIT) or died with its connection
        assert stats.connections <= MAX_CONNECTIONS
        assert stats.keys == len(self.table)


@pytest.fixture(params=["asyncio", "trio"])
def portal(request: pytest.FixtureRequest) -> Iterator[anyio.from_thread.BlockingPortal]:
    with anyio.from_thread.start_blocking_portal(request.param) as portal:
        yield portal


def test_client_and_server_follow_the_model(portal: anyio.from_thread.BlockingPortal) -> None:
    machine = type("StoreModelOnPortal", (StoreModel,), {"portal": portal})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=25,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
