"""Async client of torch's TCPStore protocol.

Theory of operation
-------------------
Like torch's client, every key goes on the wire as ``"/" + key``, so keys written here are the keys torch's
``TCPStore`` reads, and the reverse.

Operations that answer at once (SET, ADD, COMPARE_SET, GET after a wait, ...) share one *command* connection,
serialized by a lock, exactly as torch serializes its one socket: requests from one client therefore reach the
server in the order they were issued, which keeps read-your-writes for reply-less requests such as SET.

A WAIT (also the one before a GET) holds the command connection too, while no other wait does: a client then
costs the server one connection, which is what lets ten thousand nodes share one store. A command that arrives
meanwhile *preempts* the wait: the waiter sends CANCEL_WAIT and hands the lock at once to the commands queued
on it; the first sends its request right behind and reads the two replies owed first (the codec pairs them with
the WAIT and the CANCEL_WAIT), so a preemption adds no round trip of its own. The waiter sends its WAIT again once
the commands are through (WAIT is idempotent: if its keys arrived before the cancel, the new WAIT finds them at
once; a BARRIER is not idempotent).
Other blocking operations (a second concurrent wait, BARRIER) each borrow a *wait* connection from a small
pool, so a task waiting for a key never holds up another task's SET.

Cancellation: a blocking wait that is cancelled sends CANCEL_WAIT under a shield with a short grace and reads
the two replies, leaving its connection usable. Anything else interrupted mid-exchange marks its connection
broken; it is closed and a new one is opened on next use.

Connecting retries refused/reset connections with jittered exponential backoff for as long as the caller's
deadline allows; when the next attempt would not fit, :class:`~aelastic.errors.StoreConnectionError` names the
address and the last error. The handshake (VALIDATE, the auth token CHECK of :mod:`aelastic.store.auth`, PING) is
one write and one round trip; a store that refuses the token (or its absence) raises
:class:`~aelastic.errors.StoreAuthError` at once, without retrying.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Final, TypeVar

import anyio
import anyio.abc

from ..errors import QueueEmptyError, StoreAuthError, StoreConnectionError, StoreProtocolError
from . import _stream, auth, wire
from .api import Store, Value, as_bytes

__all__ = ["StoreClient", "open_store_client"]

logger = logging.getLogger(__name__)

_KEY_PREFIX: Final = "/"  # torch's TCPStore keyPrefix_
_RECEIVE_SIZE: Final = 65536
_CONNECTION_LOST: Final = (OSError, anyio.BrokenResourceError, anyio.EndOfStream)
# How long a cancelled wait may take to hand its connection back: a live server answers CANCEL_WAIT at once; a
# dead or silent one must not hold up the cancellation (the connection is then discarded, which is harmless).
_CANCEL_GRACE: Final = 1.0
_BACKOFF_INITIAL: Final = 0.02
_BACKOFF_MAX: Final = 2.0
_IDLE_WAIT_CONNECTIONS: Final = 4  # wait connections kept open for reuse

R = TypeVar("R", bound=wire.Reply)


def _wire_key(key: str) -> bytes:
    return (_KEY_PREFIX + key).encode()


class _Connection:
    """One socket and its protocol state. Not safe for concurrent use: callers serialize."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.protocol = wire.ClientProtocol()
        self.broken = False

    async def send(self, *requests: wire.Request) -> None:
        data = b"".join(self.protocol.send(request) for request in requests)
        try:
            await self.stream.send(data)
        except BaseException:
            self.broken = True
            raise

    async def receive_any(self) -> wire.Reply:
        try:
            while (reply := self.protocol.next_reply()) is wire.NEED_DATA:
                self.protocol.receive_data(await self.stream.receive(_RECEIVE_SIZE))
        except anyio.get_cancelled_exc_class():
            raise  # the protocol state is intact: the reply is still owed and will be drained or cancelled
        except BaseException:
            self.broken = True
            raise
        return reply

    async def receive(self, kind: type[R]) -> R:
        """The next reply, which must be of ``kind``."""
        reply = await self.receive_any()
        if not isinstance(reply, kind):
            self.broken = True
            raise StoreProtocolError(f"expected {kind.__name__}, got {reply!r}")
        return reply

    async def settle(self) -> None:
        """Read the replies still owed to requests whose callers were cancelled."""
        while self.protocol.pending:
            await self.receive_any()

    async def take_back(self) -> wire.WaitReply | None:
        """Cancel the outstanding wait, within a short grace whatever cancels the caller: the wait's own reply
        (STOP_WAITING if its keys arrived before the cancel), or ``None`` if the server did not answer in time
        (the connection is then broken)."""
        with anyio.move_on_after(_CANCEL_GRACE, shield=True), suppress(*_CONNECTION_LOST):
            await self.send(wire.CancelWait())
            reply = await self.receive(wire.WaitReply)
            await self.receive(wire.WaitReply)  # the cancel's: WAIT_CANCELED
            return reply
        self.broken = True
        return None

    async def roundtrip(self, request: wire.Request, kind: type[R]) -> R:
        # Replies owed to requests whose caller was cancelled may still be in flight: drain them first.
        stale = self.protocol.pending
        await self.send(request)
        for _ in range(stale):
            await self.receive_any()
        return await self.receive(kind)

    async def aclose(self) -> None:
        await self.stream.aclose()


class StoreClient(Store):
    """A client of one TCPStore server (aelastic's or torch's). Create it with :func:`open_store_client`."""

    def __init__(self, host: str, port: int, *, auth_token: str | None = None) -> None:
        self.host = host
        self.port = port
        self._auth_token = None if auth_token is None else auth.check_token(auth_token)
        self._command: _Connection | None = None
        self._command_lock = anyio.Lock(fast_acquire=True)
        self._command_waiter = False  # a wait holds (or queues for) the command connection
        self._preempt: anyio.CancelScope | None = None  # cancels that wait's receive when a command arrives
        self._idle: list[_Connection] = []
        self._open = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"<StoreClient {self.address} connections={self._open} idle={len(self._idle)}>"

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # --- connections ------------------------------------------------------------------------------------------

    async def _connect(self) -> _Connection:
        if self._closed:
            raise StoreConnectionError(f"store client for {self.address} is closed")
        delay = _BACKOFF_INITIAL
        while True:
            try:
                stream = await _stream.connect(self.host, self.port)
            except OSError as exc:
                error: OSError = exc
            else:
                conn = _Connection(stream)
                try:
                    await self._handshake(conn)
                except (OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
                    await anyio.aclose_forcefully(stream)
                    if isinstance(exc, StoreAuthError):
                        raise  # a refusal is final
                    # The server may be starting, stopping or full: try again.
                    error = exc if isinstance(exc, OSError) else OSError("connection closed during handshake")
                except BaseException:
                    await anyio.aclose_forcefully(stream)
                    raise
                else:
                    self._open += 1
                    return conn
            pause = delay * random.uniform(0.5, 1.5)
            # Give up, naming the store, unless the pause and one more attempt (given the pause's length again)
            # fit before the caller's deadline: on a busy machine the loop wakes late, and the deadline would then
            # fire first with a bare TimeoutError.
            if anyio.current_time() + 2 * pause >= anyio.current_effective_deadline():
                raise StoreConnectionError(f"could not connect to the store at {self.address}: {error}") from error
            logger.debug("store at %s not reachable (%s); retrying in %.3fs", self.address, error, pause)
            await anyio.sleep(pause)
            delay = min(delay * 1.5, _BACKOFF_MAX)

    async def _handshake(self, conn: _Connection) -> None:
        nonce = os.getpid() & 0xFFFFFFFF
        await conn.send(wire.Validate(), auth.token_request(self._auth_token), wire.Ping(nonce))
        token_check = await conn.receive(wire.CheckReply)
        try:
            reply = await conn.receive(wire.PingReply)
        except (OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            if token_check.response is wire.CheckResponse.NOT_READY:  # NOT_READY, then closed: refused
                raise StoreAuthError(self._refusal()) from exc
            raise
        if reply.nonce != nonce:
            raise StoreProtocolError(f"ping answered with nonce {reply.nonce}, expected {nonce}")

    def _refusal(self) -> str:
        if self._auth_token is None:
            return (
                f"the store at {self.address} requires an auth token and this client has none: set --rdzv-conf "
                f"auth_token=... (or {auth.AUTH_TOKEN_ENV}) to the token of the node that serves it"
            )
        return (
            f"the store at {self.address} refused this client's auth token: every node must use the same "
            f"--rdzv-conf auth_token (or {auth.AUTH_TOKEN_ENV})"
        )

    async def _discard(self, conn: _Connection) -> None:
        self._open -= 1
        await anyio.aclose_forcefully(conn.stream)

    @asynccontextmanager
    async def _command_turn(self) -> AsyncIterator[_Connection]:
        """The command connection, to this task alone; a wait holding it is preempted."""
        if self._preempt is not None:
            self._preempt.cancel()
        async with self._command_lock:
            conn = await self._command_connection()
            try:
                yield conn
            except _CONNECTION_LOST as exc:
                raise self._lost(exc) from exc
            finally:
                await self._drop_command_if_broken()

    async def _command_call(self, request: wire.Request, kind: type[R]) -> R:
        async with self._command_turn() as conn:
            return await conn.roundtrip(request, kind)

    async def _command_post(self, request: wire.Request) -> None:
        async with self._command_turn() as conn:
            await conn.send(request)

    async def _command_connection(self) -> _Connection:
        if self._command is None:
            self._command = await self._connect()
        return self._command

    async def _command_wait(self, request: wire.Wait) -> None:
        """WAIT on the command connection, yielding it to every command that arrives meanwhile."""
        self._command_waiter = True
        try:
            while True:
                async with self._command_lock:  # handed over in order: queued commands go first
                    if await self._wait_turn(request):
                        return
        finally:
            self._command_waiter = False

    async def _wait_turn(self, request: wire.Wait) -> bool:
        """One WAIT on the command connection (its lock held): whether its keys arrived, or a command preempted
        it (False: send it again after the commands)."""
        # From here on a command cancels this scope; one queued before it is seen below, before the WAIT.
        self._preempt = preempt = anyio.CancelScope()
        outstanding = False  # the WAIT is sent and neither answered nor taken back
        try:
            conn = await self._command_connection()
            await conn.settle()
            if self._command_lock.statistics().tasks_waiting:
                return False
            await conn.send(request)
            outstanding = True
            with preempt:
                reply = await conn.receive(wire.WaitReply)
            if preempt.cancelled_caught:
                # Hand the connection over at once, its two replies still owed: the command that preempted the
                # wait sends its request right behind the CANCEL_WAIT and reads them first (``roundtrip``; a
                # reply-less command leaves them to ``settle`` above), one round trip for both. If the wait's keys
                # came first (its reply is STOP_WAITING), the WAIT sent again finds them at once.
                await conn.send(wire.CancelWait())
                outstanding = False
                return False
            outstanding = False
        except anyio.get_cancelled_exc_class():
            if outstanding and not conn.broken:
                await conn.take_back()
            raise
        except _CONNECTION_LOST as exc:
            if isinstance(exc, StoreConnectionError):
                raise  # from connecting: it names the store already
            raise self._lost(exc) from exc
        finally:
            self._preempt = None
            await self._drop_command_if_broken()
        if reply.response is wire.WaitResponse.WAIT_CANCELED:
            return False
        if reply.response is not wire.WaitResponse.STOP_WAITING:
            raise StoreProtocolError(f"Wait answered with {reply.response.name}")
        return True

    async def _drop_command_if_broken(self) -> None:
        if self._command is not None and self._command.broken:
            conn, self._command = self._command, None
            with anyio.CancelScope(shield=True):
                await self._discard(conn)

    def _lost(self, exc: BaseException) -> StoreConnectionError:
        return StoreConnectionError(f"lost the connection to the store at {self.address}: {exc!r}")

    async def _blocking(self, request: wire.Wait | wire.Barrier) -> None:
        """Send a request the server answers only once its condition holds: a WAIT on the command connection
        while no other wait holds it, anything else on a wait connection of its own."""
        if isinstance(request, wire.Wait) and not self._command_waiter:
            await self._command_wait(request)
            return
        conn = self._idle.pop() if self._idle else await self._connect()
        handed_back = False
        try:
            await conn.send(request)
            try:
                reply = await conn.receive(wire.WaitReply)
            except anyio.get_cancelled_exc_class():
                # A connection lost meanwhile (the server shutting down in the same cancellation) is discarded
                # below; the cancellation, not the lost connection, is what the caller must see.
                if await conn.take_back() is not None:
                    await self._release(conn)
                    handed_back = True
                raise
            if reply.response is not wire.WaitResponse.STOP_WAITING:
                raise StoreProtocolError(f"{type(request).__name__} answered with {reply.response.name}")
            await self._release(conn)
            handed_back = True
        except _CONNECTION_LOST as exc:
            raise self._lost(exc) from exc
        finally:
            if not handed_back:
                with anyio.CancelScope(shield=True):
                    await self._discard(conn)

    async def _release(self, conn: _Connection) -> None:
        """Keep a healthy wait connection for reuse, or close it."""
        if conn.broken or self._closed or len(self._idle) >= _IDLE_WAIT_CONNECTIONS:
            with anyio.CancelScope(shield=True):
                await self._discard(conn)
        else:
            self._idle.append(conn)

    async def aclose(self) -> None:
        """Close every connection. Pending operations of other tasks fail with ``StoreConnectionError``."""
        self._closed = True
        if self._preempt is not None:
            self._preempt.cancel()
        with anyio.CancelScope(shield=True):
            async with self._command_lock:
                if self._command is not None:
                    conn, self._command = self._command, None
                    await self._discard(conn)
            while self._idle:
                await self._discard(self._idle.pop())

    # --- the Store API ------------------------------------------------------------------------------------------

    async def set(self, key: str, value: Value) -> None:
        await self._command_post(wire.Set(_wire_key(key), as_bytes(value)))

    async def get(self, key: str) -> bytes:
        await self.wait([key])
        return (await self._command_call(wire.Get(_wire_key(key)), wire.ValueReply)).value

    async def add(self, key: str, amount: int) -> int:
        return (await self._command_call(wire.Add(_wire_key(key), amount), wire.IntReply)).value

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        request = wire.CompareSet(_wire_key(key), as_bytes(expected), as_bytes(desired))
        return (await self._command_call(request, wire.ValueReply)).value

    async def wait(self, keys: Sequence[str]) -> None:
        await self._blocking(wire.Wait(tuple(map(_wire_key, keys))))

    async def check(self, keys: Sequence[str]) -> bool:
        reply = await self._command_call(wire.Check(tuple(map(_wire_key, keys))), wire.CheckReply)
        return reply.response is wire.CheckResponse.READY

    async def delete_key(self, key: str) -> bool:
        return (await self._command_call(wire.DeleteKey(_wire_key(key)), wire.IntReply)).value > 0

    async def num_keys(self) -> int:
        return (await self._command_call(wire.GetNumKeys(), wire.IntReply)).value

    async def append(self, key: str, value: Value) -> None:
        await self._command_post(wire.Append(_wire_key(key), as_bytes(value)))

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        await self.wait(keys)
        reply = await self._command_call(wire.MultiGet(tuple(map(_wire_key, keys))), wire.ValuesReply)
        return list(reply.values)

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys and {len(values)} values; they must pair up")
        items = tuple((_wire_key(k), as_bytes(v)) for k, v in zip(keys, values, strict=True))
        await self._command_post(wire.MultiSet(items))

    async def queue_push(self, key: str, value: Value) -> None:
        await self._command_post(wire.QueuePush(_wire_key(key), as_bytes(value)))

    async def queue_pop(self, key: str, *, block: bool = True) -> bytes:
        while True:
            if block:
                await self.wait([key])
            reply = await self._command_call(wire.QueuePop(_wire_key(key)), wire.QueuePopReply)
            if reply.value is not None:
                return reply.value
            if not block:
                raise QueueEmptyError(f"queue {key!r} is empty")
            # Another client popped the element that woke us: wait for the next one.

    async def queue_len(self, key: str) -> int:
        return (await self._command_call(wire.QueueLen(_wire_key(key)), wire.IntReply)).value

    async def list_keys(self) -> list[str]:
        reply = await self._command_call(wire.ListKeys(), wire.KeysReply)
        keys = (k.decode(errors="replace") for k in reply.keys)
        return [k[len(_KEY_PREFIX) :] for k in keys if k.startswith(_KEY_PREFIX)]

    async def barrier(self, key: str, world_size: int) -> None:
        await self._blocking(wire.Barrier(_wire_key(key), world_size))

    async def local_address(self) -> str:
        """This host's address on the connection to the server: an address the server's host can reach."""
        async with self._command_turn() as conn:
            address = conn.stream.extra(anyio.abc.SocketAttribute.local_address)
        host = str(address[0]) if isinstance(address, tuple) else str(address)
        return host.removeprefix("::ffff:")  # an IPv4 peer seen through a dual-stack socket

    async def ping(self) -> None:
        """One round trip to the server."""
        nonce = random.getrandbits(32)
        reply = await self._command_call(wire.Ping(nonce), wire.PingReply)
        if reply.nonce != nonce:
            raise StoreProtocolError(f"ping answered with nonce {reply.nonce}, expected {nonce}")


@asynccontextmanager
async def open_store_client(host: str, port: int, *, auth_token: str | None = None) -> AsyncIterator[StoreClient]:
    """Connect to the TCPStore server at ``host:port`` (aelastic's or torch's).

    The first connection is opened before this yields, retrying within the caller's deadline, so an unreachable
    address fails here with :class:`~aelastic.errors.StoreConnectionError` naming it, and a store that refuses
    ``auth_token`` (or its absence) with :class:`~aelastic.errors.StoreAuthError`. Every connection is closed on
    exit.
    """
    client = StoreClient(host, port, auth_token=auth_token)
    try:
        async with client._command_lock:
            client._command = await client._connect()
        yield client
    finally:
        await client.aclose()
