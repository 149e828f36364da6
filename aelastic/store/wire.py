"""Sans-IO codec of torch's TCPStore wire protocol (torch 2.13/2.14 layout).

Theory of operation
-------------------
The protocol has no framing: a request is a one-byte query type followed by fields whose sizes are only known
while parsing (``u64`` length-prefixed strings, ``i64``/``u32`` integers, all little-endian). Replies carry no
type at all: a client knows the shape of the next reply from the request it sent. So there are two parsers:

* :class:`RequestParser` (server side, in ``_request_parser.py``) turns bytes into typed requests. A request is
  consumed only once all of its bytes are buffered; until then :data:`NEED_DATA` is returned and nothing is
  consumed. Limits (key and value lengths, keys per request) are checked as soon as a length prefix is read, so an
  absurd prefix is refused before any memory is reserved for it.
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
from ._request_parser import RequestParser

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
