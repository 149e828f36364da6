"""Sans-IO codec of torch's TCPStore wire protocol (torch 2.13/2.14 layout).

Theory of operation
-------------------
The protocol has no framing: a request is a one-byte query type followed by fields whose sizes are only known
while parsing (``u64`` length-prefixed strings, ``i64``/``u32`` integers, all little-endian). Replies carry no
type at all: a client knows the shape of the next reply from the request it sent. So there are two parsers:

* :class:`RequestParser` (server side) turns bytes into typed requests. A request is consumed only once all of
  its bytes are buffered; until then :data:`NEED_DATA` is returned and nothing is consumed. Limits (key and value
  lengths, keys per request) are checked as soon as a length prefix is read, so an absurd prefix is refused
  before any memory is reserved for it.
* :class:`ClientProtocol` (client side) encodes requests, remembers which reply shape each one expects, and
  turns reply bytes into typed replies in order.

The one subtle exchange is the cancelled wait: after ``WAIT`` (or ``BARRIER``) a client that gives up sends
``CANCEL_WAIT``; the server answers it with ``WAIT_CANCELED``, and the wait itself is answered with
``STOP_WAITING`` only if the keys arrived first. :class:`ClientProtocol` folds that race into replies that
always match requests one for one.

Nothing here touches a socket, a clock or a logger.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Final, cast

from ..errors import StoreProtocolError
from ._messages import (  # the message types, defined apart to keep this module to the codec
    NEED_DATA,
    VALIDATION_MAGIC,
    Add,
    Append,
    Barrier,
    CancelWait,
    Check,
    CheckReply,
    CheckResponse,
    CompareSet,
    DeleteKey,
    Get,
    GetNumKeys,
    IntReply,
    KeysReply,
    Limits,
    ListKeys,
    MultiGet,
    MultiSet,
    NeedData,
    Ping,
    PingReply,
    QueryType,
    QueueLen,
    QueuePop,
    QueuePopReply,
    QueuePush,
    Reply,
    Request,
    Set,
    Validate,
    ValueReply,
    ValuesReply,
    Wait,
    WaitReply,
    WaitResponse,
)

__all__ = [
    "NEED_DATA",
    "VALIDATION_MAGIC",
    "Add",
    "Append",
    "Barrier",
    "CancelWait",
    "Check",
    "CheckReply",
    "CheckResponse",
    "ClientProtocol",
    "CompareSet",
    "DeleteKey",
    "Get",
    "GetNumKeys",
    "IntReply",
    "KeysReply",
    "Limits",
    "ListKeys",
    "MultiGet",
    "MultiSet",
    "NeedData",
    "Ping",
    "PingReply",
    "QueryType",
    "QueueLen",
    "QueuePop",
    "QueuePopReply",
    "QueuePush",
    "Reply",
    "Request",
    "RequestParser",
    "Set",
    "Validate",
    "ValueReply",
    "ValuesReply",
    "Wait",
    "WaitReply",
    "WaitResponse",
    "encode_reply",
    "encode_request",
]

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


# --- encoding -------------------------------------------------------------------------------------------------


def _string(value: bytes) -> bytes:
    return _U64.pack(len(value)) + value


def encode_request(request: Request) -> bytes:
    """The bytes torch's client sends for ``request``."""
    match request:
        case Validate(magic):
            return bytes((QueryType.VALIDATE,)) + _U32.pack(magic)
        case Set(key, value):
            return bytes((QueryType.SET,)) + _string(key) + _string(value)
        case CompareSet(key, expected, desired):
            return bytes((QueryType.COMPARE_SET,)) + _string(key) + _string(expected) + _string(desired)
        case Get(key):
            return bytes((QueryType.GET,)) + _string(key)
        case Add(key, delta):
            return bytes((QueryType.ADD,)) + _string(key) + _I64.pack(delta)
        case Check(keys):
            return bytes((QueryType.CHECK,)) + _U64.pack(len(keys)) + b"".join(map(_string, keys))
        case Wait(keys):
            return bytes((QueryType.WAIT,)) + _U64.pack(len(keys)) + b"".join(map(_string, keys))
        case GetNumKeys():
            return bytes((QueryType.GETNUMKEYS,))
        case DeleteKey(key):
            return bytes((QueryType.DELETE_KEY,)) + _string(key)
        case Append(key, value):
            return bytes((QueryType.APPEND,)) + _string(key) + _string(value)
        case MultiGet(keys):
            return bytes((QueryType.MULTI_GET,)) + _U64.pack(len(keys)) + b"".join(map(_string, keys))
        case MultiSet(items):
            body = b"".join(_string(k) + _string(v) for k, v in items)
            return bytes((QueryType.MULTI_SET,)) + _I64.pack(len(items)) + body
        case CancelWait():
            return bytes((QueryType.CANCEL_WAIT,))
        case Ping(nonce):
            return bytes((QueryType.PING,)) + _U32.pack(nonce)
        case QueuePush(key, value):
            return bytes((QueryType.QUEUE_PUSH,)) + _string(key) + _string(value)
        case QueuePop(key):
            return bytes((QueryType.QUEUE_POP,)) + _string(key)
        case QueueLen(key):
            return bytes((QueryType.QUEUE_LEN,)) + _string(key)
        case ListKeys():
            return bytes((QueryType.LIST_KEYS,))
        case Barrier(key, world_size):
            return bytes((QueryType.BARRIER,)) + _string(key) + _I64.pack(world_size)
    raise TypeError(f"not a TCPStore request: {request!r}")


def encode_reply(reply: Reply) -> bytes:
    """The bytes torch's server sends for ``reply``."""
    match reply:
        case ValueReply(value):
            return _string(value)
        case IntReply(value):
            return _I64.pack(value)
        case CheckReply(response):
            return _U8.pack(response)
        case WaitReply(response):
            return _U8.pack(response)
        case PingReply(nonce):
            return _U32.pack(nonce)
        case ValuesReply(values):
            return b"".join(map(_string, values))
        case QueuePopReply(length, value):
            return _I64.pack(length) + (b"" if value is None else _string(value))
        case KeysReply(keys):
            return _I64.pack(len(keys)) + b"".join(map(_string, keys))
    raise TypeError(f"not a TCPStore reply: {reply!r}")


# --- decoding -------------------------------------------------------------------------------------------------


class _Incomplete(Exception):
    """Raised inside a parse when the buffer ends before the message does; never escapes this module."""


class _Buffer:
    """A growable receive buffer with a read cursor that can be rolled back to the last committed message."""

    __slots__ = ("_data", "_pos")

    def __init__(self) -> None:
        self._data = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        if self._pos:
            del self._data[: self._pos]
            self._pos = 0
        self._data += data

    def __len__(self) -> int:
        return len(self._data) - self._pos

    def take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._data):
            raise _Incomplete
        chunk = bytes(self._data[self._pos : end])
        self._pos = end
        return chunk

    def unpack(self, fmt: struct.Struct) -> int:
        end = self._pos + fmt.size
        if end > len(self._data):
            raise _Incomplete
        (value,) = fmt.unpack_from(self._data, self._pos)
        self._pos = end
        return int(value)

    def mark(self) -> int:
        return self._pos

    def rewind(self, mark: int) -> None:
        self._pos = mark


# --- the server's parser --------------------------------------------------------------------------------------
_Bytes = bytes | bytearray  # what RequestParser buffers: see receive_data
_JOIN_LIMIT: Final = 4096  # a partial request larger than this grows a bytearray instead
# The server's hot path: one function per query type, found by the query byte, reads the fields straight out of
# the receive buffer. Each takes (limits, buffer, position after the query byte) and returns the request and the
# position after it, or raises _Incomplete when the buffer ends first (once per received chunk, not per field).


def _string_at(data: _Bytes, pos: int, limit: int, what: str) -> tuple[bytes, int]:
    start = pos + 8
    if start > len(data):
        raise _Incomplete
    (n,) = _U64.unpack_from(data, pos)
    if n > limit:  # checked before the body arrives, so that an absurd length reserves nothing
        raise StoreProtocolError(f"{what} of {n} bytes exceeds the limit of {limit} bytes")
    end = start + n
    if end > len(data):
        raise _Incomplete
    return bytes(data[start:end]), end


def _int_at(data: _Bytes, pos: int, fmt: struct.Struct) -> tuple[int, int]:
    end = pos + fmt.size
    if end > len(data):
        raise _Incomplete
    return int(fmt.unpack_from(data, pos)[0]), end


def _count_at(limits: Limits, data: _Bytes, pos: int, fmt: struct.Struct) -> tuple[int, int]:
    n, pos = _int_at(data, pos, fmt)
    if not 0 <= n <= limits.max_keys_per_request:
        raise StoreProtocolError(f"request names {n} keys; the limit is 0..{limits.max_keys_per_request}")
    return n, pos


def _keys_at(limits: Limits, data: _Bytes, pos: int) -> tuple[tuple[bytes, ...], int]:
    n, pos = _count_at(limits, data, pos, _U64)
    keys = []
    for _ in range(n):
        key, pos = _string_at(data, pos, limits.max_key_length, "key")
        keys.append(key)
    return tuple(keys), pos


def _key_value_at(limits: Limits, data: _Bytes, pos: int) -> tuple[bytes, bytes, int]:
    # Two _string_at calls, inlined: SET is the hottest request, and a call costs as much as the rest of it.
    size = len(data)
    if pos + 8 > size:
        raise _Incomplete
    (n,) = _U64.unpack_from(data, pos)
    if n > limits.max_key_length:
        raise StoreProtocolError(f"key of {n} bytes exceeds the limit of {limits.max_key_length} bytes")
    key_end = pos + 8 + n
    if key_end + 8 > size:
        raise _Incomplete
    (m,) = _U64.unpack_from(data, key_end)
    if m > limits.max_value_length:
        raise StoreProtocolError(f"value of {m} bytes exceeds the limit of {limits.max_value_length} bytes")
    end = key_end + 8 + m
    if end > size:
        raise _Incomplete
    return bytes(data[pos + 8 : key_end]), bytes(data[key_end + 8 : end]), end


def _parse_validate(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    magic, pos = _int_at(data, pos, _U32)
    return Validate(magic), pos


def _parse_set(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    key, value, pos = _key_value_at(limits, data, pos)
    return Set(key, value), pos


def _parse_compare_set(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    key, expected, pos = _key_value_at(limits, data, pos)
    desired, pos = _string_at(data, pos, limits.max_value_length, "value")
    return CompareSet(key, expected, desired), pos


def _parse_get(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    key, pos = _string_at(data, pos, limits.max_key_length, "key")
    return Get(key), pos


def _parse_add(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    key, pos = _string_at(data, pos, limits.max_key_length, "key")
    delta, pos = _int_at(data, pos, _I64)
    return Add(key, delta), pos


def _parse_check(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    keys, pos = _keys_at(limits, data, pos)
    return Check(keys), pos


def _parse_wait(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    keys, pos = _keys_at(limits, data, pos)
    return Wait(keys), pos


def _parse_get_num_keys(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    return GetNumKeys(), pos


def _parse_delete_key(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    key, pos = _string_at(data, pos, limits.max_key_length, "key")
    return DeleteKey(key), pos


def _parse_append(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    key, value, pos = _key_value_at(limits, data, pos)
    return Append(key, value), pos


def _parse_multi_get(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    keys, pos = _keys_at(limits, data, pos)
    return MultiGet(keys), pos


def _parse_multi_set(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    n, pos = _count_at(limits, data, pos, _I64)  # MULTI_SET's count is signed
    items = []
    for _ in range(n):
        key, value, pos = _key_value_at(limits, data, pos)
        items.append((key, value))
    return MultiSet(tuple(items)), pos


def _parse_cancel_wait(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    return CancelWait(), pos


def _parse_ping(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    nonce, pos = _int_at(data, pos, _U32)
    return Ping(nonce), pos


def _parse_queue_push(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    key, value, pos = _key_value_at(limits, data, pos)
    return QueuePush(key, value), pos


def _parse_queue_pop(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    key, pos = _string_at(data, pos, limits.max_key_length, "key")
    return QueuePop(key), pos


def _parse_queue_len(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    key, pos = _string_at(data, pos, limits.max_key_length, "key")
    return QueueLen(key), pos


def _parse_list_keys(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    return ListKeys(), pos


def _parse_barrier(limits: Limits, data: _Bytes, pos: int) -> tuple[Request, int]:
    key, pos = _string_at(data, pos, limits.max_key_length, "key")
    world_size, pos = _int_at(data, pos, _I64)
    return Barrier(key, world_size), pos


_REQUEST_PARSERS: Final[dict[QueryType, Callable[[Limits, _Bytes, int], tuple[Request, int]]]] = {
    QueryType.VALIDATE: _parse_validate,
    QueryType.SET: _parse_set,
    QueryType.COMPARE_SET: _parse_compare_set,
    QueryType.GET: _parse_get,
    QueryType.ADD: _parse_add,
    QueryType.CHECK: _parse_check,
    QueryType.WAIT: _parse_wait,
    QueryType.GETNUMKEYS: _parse_get_num_keys,
    QueryType.DELETE_KEY: _parse_delete_key,
    QueryType.APPEND: _parse_append,
    QueryType.MULTI_GET: _parse_multi_get,
    QueryType.MULTI_SET: _parse_multi_set,
    QueryType.CANCEL_WAIT: _parse_cancel_wait,
    QueryType.PING: _parse_ping,
    QueryType.QUEUE_PUSH: _parse_queue_push,
    QueryType.QUEUE_POP: _parse_queue_pop,
    QueryType.QUEUE_LEN: _parse_queue_len,
    QueryType.LIST_KEYS: _parse_list_keys,
    QueryType.BARRIER: _parse_barrier,
}
_PARSER_BY_CODE: Final = tuple(_REQUEST_PARSERS[query] for query in sorted(QueryType))  # indexed by the byte
_SET: Final = int(QueryType.SET)
_GET: Final = int(QueryType.GET)
_ADD: Final = int(QueryType.ADD)
_U64_FROM: Final = _U64.unpack_from
_I64_FROM: Final = _I64.unpack_from
# tuple.__new__ bound to the class: builds the NamedTuple without running its Python-level __new__.
_NEW_SET: Final = cast("Callable[[tuple[bytes, bytes]], Set]", partial(tuple.__new__, Set))
_NEW_GET: Final = cast("Callable[[tuple[bytes]], Get]", partial(tuple.__new__, Get))
_NEW_ADD: Final = cast("Callable[[tuple[bytes, int]], Add]", partial(tuple.__new__, Add))


class RequestParser:
    """Server side: bytes in, typed requests out.

    Feed bytes with :meth:`receive_data`; call :meth:`next_request` until it returns :data:`NEED_DATA`. A
    malformed or over-limit request raises :class:`~aelastic.errors.StoreProtocolError`; the connection must
    then be closed (the stream cannot be resynchronised).
    """

    __slots__ = ("_data", "_pos", "limits")

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._data: _Bytes = b""
        self._pos = 0  # start of the first request not yet returned

    def __repr__(self) -> str:
        return f"<RequestParser buffered={self.buffered}>"

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed as a whole request."""
        return len(self._data) - self._pos

    def receive_data(self, data: bytes) -> None:
        # The buffer is the received bytes object itself where possible, so that a key or value is one slice of it
        # (slicing a bytearray and converting costs twice as much, on the server's hottest path). Only while a
        # large request arrives in pieces does it grow a bytearray: joining bytes would copy the part already
        # received again for every piece.
        rest = len(self._data) - self._pos
        if not rest:
            self._data = data
        elif isinstance(self._data, bytearray):
            del self._data[: self._pos]
            self._data += data
        elif rest <= _JOIN_LIMIT:
            self._data = self._data[self._pos :] + data
        else:
            grown = bytearray(self._data[self._pos :])
            grown += data
            self._data = grown
        self._pos = 0

    def store_sets(self, table: dict[bytes, bytes]) -> int:
        """Store the whole SET requests at the head of the buffer straight into ``table``; how many it stored.

        A run of SETs (no reply each) is where parsing is all a server does: here without a request object, a
        call or a dispatch per SET (``benchmarks/store_ops.py``, SETs of 8 torch clients: 0.68× torch's ops/s
        with a request object per SET, 1.00× with this). It stops at anything else (another kind, a SET not yet
        whole or over a limit, a buffer that is a bytearray), which :meth:`next_request` then handles or rejects.
        """
        data, pos = self._data, self._pos
        if type(data) is not bytes:  # slices of a bytearray are not keys; only large requests in pieces get here
            return 0
        size = len(data)
        max_key, max_value = self.limits.max_key_length, self.limits.max_value_length
        unpack, code = _U64_FROM, _SET
        start = pos
        count = 0
        while pos + 9 <= size and data[pos] == code:
            (n,) = unpack(data, pos + 1)
            key_end = pos + 9 + n
            if n > max_key or key_end + 8 > size:
                break
            (m,) = unpack(data, key_end)
            end = key_end + 8 + m
            if m > max_value or end > size:
                break
            table[data[pos + 9 : key_end]] = data[key_end + 8 : end]
            pos = end
            count += 1
        if pos != start:
            self._pos = pos
        return count

    def next_request(self) -> Request | NeedData:
        data, pos = self._data, self._pos
        size = len(data)
        if pos >= size:
            return NEED_DATA
        code = data[pos]
        # SET, GET and ADD whole and within the limits, inline: a parse function, a field function and a
        # NamedTuple's __new__ are three Python frames per request, as much as the rest of the request costs.
        # Anything else (incomplete, over a limit, another kind) goes the general way below, which decides.
        if code == _SET and pos + 9 <= size:
            (n,) = _U64_FROM(data, pos + 1)
            key_end = pos + 9 + n
            if n <= self.limits.max_key_length and key_end + 8 <= size:
                (m,) = _U64_FROM(data, key_end)
                end = key_end + 8 + m
                if m <= self.limits.max_value_length and end <= size:
                    self._pos = end
                    return _NEW_SET((bytes(data[pos + 9 : key_end]), bytes(data[key_end + 8 : end])))
        elif code == _GET and pos + 9 <= size:
            (n,) = _U64_FROM(data, pos + 1)
            end = pos + 9 + n
            if n <= self.limits.max_key_length and end <= size:
                self._pos = end
                return _NEW_GET((bytes(data[pos + 9 : end]),))
        elif code == _ADD and pos + 9 <= size:
            (n,) = _U64_FROM(data, pos + 1)
            key_end = pos + 9 + n
            if n <= self.limits.max_key_length and key_end + 8 <= size:
                self._pos = key_end + 8
                return _NEW_ADD((bytes(data[pos + 9 : key_end]), _I64_FROM(data, key_end)[0]))
        if code >= len(_PARSER_BY_CODE):
            raise StoreProtocolError(f"unknown query type {code}")
        try:
            request, self._pos = _PARSER_BY_CODE[code](self.limits, data, pos + 1)
        except _Incomplete:
            return NEED_DATA  # nothing consumed: parsed again from its first byte once more bytes arrive
        return request


class _Shape(enum.Enum):
    """What the next reply looks like; derived from the request that asked for it."""

    NONE = enum.auto()
    VALUE = enum.auto()
    INT = enum.auto()
    CHECK = enum.auto()
    WAIT = enum.auto()
    CANCEL = enum.auto()
    PING = enum.auto()
    VALUES = enum.auto()
    QUEUE_POP = enum.auto()
    KEYS = enum.auto()


def _shape_of(request: Request) -> tuple[_Shape, int]:
    match request:
        case Validate() | Set() | Append() | MultiSet() | QueuePush():
            return _Shape.NONE, 0
        case Get() | CompareSet():
            return _Shape.VALUE, 0
        case Add() | GetNumKeys() | DeleteKey() | QueueLen():
            return _Shape.INT, 0
        case Check():
            return _Shape.CHECK, 0
        case Wait() | Barrier():
            return _Shape.WAIT, 0
        case CancelWait():
            return _Shape.CANCEL, 0
        case Ping():
            return _Shape.PING, 0
        case MultiGet(keys):
            return _Shape.VALUES, len(keys)
        case QueuePop():
            return _Shape.QUEUE_POP, 0
        case ListKeys():
            return _Shape.KEYS, 0
    raise TypeError(f"not a TCPStore request: {request!r}")


class ClientProtocol:
    """Client side: typed requests in, bytes out; reply bytes in, typed replies out, one per request.

    ``send(request)`` returns the bytes to write and records the reply the request expects (requests without
    a reply, such as SET, record nothing). ``next_reply()`` returns replies in request order.

    A cancelled wait: send ``CancelWait()`` after ``Wait``/``Barrier``. Exactly two replies follow, in order:
    the wait's (``STOP_WAITING`` if the keys arrived before the cancel, else ``WAIT_CANCELED``) and the
    cancel's (``WAIT_CANCELED``), whichever bytes the server actually sent.
    """

    def __init__(self, max_value_length: int = Limits().max_value_length) -> None:
        self._buffer = _Buffer()
        self._pending: deque[tuple[_Shape, int]] = deque()
        self._max_value_length = max_value_length
        self._folded_cancel = False

    def __repr__(self) -> str:
        return f"<ClientProtocol pending={len(self._pending)} buffered={len(self._buffer)}>"

    @property
    def pending(self) -> int:
        """How many replies are still expected."""
        return len(self._pending)

    def send(self, request: Request) -> bytes:
        shape, count = _shape_of(request)
        if shape is _Shape.CANCEL and not (self._pending and self._pending[-1][0] is _Shape.WAIT):
            raise StoreProtocolError("CANCEL_WAIT sent while no WAIT or BARRIER is outstanding")
        if shape is not _Shape.NONE:
            self._pending.append((shape, count))
        return encode_request(request)

    def receive_data(self, data: bytes) -> None:
        self._buffer.feed(data)

    def next_reply(self) -> Reply | NeedData:
        if self._folded_cancel:
            # The server answered the cancel before (instead of) the wait: the wait's reply was emitted as
            # WAIT_CANCELED already; this is the cancel's own reply, which consumed the same byte.
            self._folded_cancel = False
            self._pending.popleft()
            return WaitReply(WaitResponse.WAIT_CANCELED)
        if not self._pending:
            if len(self._buffer):
                raise StoreProtocolError(f"server sent {len(self._buffer)} bytes nobody asked for")
            return NEED_DATA
        buf = self._buffer
        mark = buf.mark()
        shape, count = self._pending[0]
        try:
            reply = self._parse(buf, shape, count)
        except _Incomplete:
            buf.rewind(mark)
            return NEED_DATA
        self._pending.popleft()
        if isinstance(reply, WaitReply) and shape is _Shape.WAIT and reply.response is WaitResponse.WAIT_CANCELED:
            if not (self._pending and self._pending[0][0] is _Shape.CANCEL):
                raise StoreProtocolError("server cancelled a wait that was not cancelled")
            self._folded_cancel = True
        return reply

    def _value(self, buf: _Buffer) -> bytes:
        n = buf.unpack(_U64)
        if n > self._max_value_length:
            raise StoreProtocolError(f"reply value of {n} bytes exceeds the limit of {self._max_value_length}")
        return buf.take(n)

    def _parse(self, buf: _Buffer, shape: _Shape, count: int) -> Reply:
        match shape:
            case _Shape.VALUE:
                return ValueReply(self._value(buf))
            case _Shape.INT:
                return IntReply(buf.unpack(_I64))
            case _Shape.CHECK:
                return CheckReply(CheckResponse(self._enum(buf, CheckResponse)))
            case _Shape.WAIT | _Shape.CANCEL:
                response = WaitResponse(self._enum(buf, WaitResponse))
                if shape is _Shape.CANCEL and response is not WaitResponse.WAIT_CANCELED:
                    raise StoreProtocolError(f"CANCEL_WAIT answered with {response.name}")
                return WaitReply(response)
            case _Shape.PING:
                return PingReply(buf.unpack(_U32))
            case _Shape.VALUES:
                return ValuesReply(tuple(self._value(buf) for _ in range(count)))
            case _Shape.QUEUE_POP:
                length = buf.unpack(_I64)
                return QueuePopReply(length, self._value(buf) if length > 0 else None)
            case _Shape.KEYS:
                n = buf.unpack(_I64)
                if n < 0:
                    raise StoreProtocolError(f"LIST_KEYS reply announces {n} keys")
                return KeysReply(tuple(self._value(buf) for _ in range(n)))
            case _Shape.NONE:
                raise AssertionError("requests without a reply are never pending")

    @staticmethod
    def _enum(buf: _Buffer, kind: type[enum.IntEnum]) -> int:
        code = buf.unpack(_U8)
        if code not in kind._value2member_map_:
            raise StoreProtocolError(f"reply byte {code} is not a {kind.__name__}")
        return code
