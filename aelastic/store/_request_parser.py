"""The server's side of torch's TCPStore wire protocol: bytes in, typed requests out (:class:`RequestParser`,
re-exported by :mod:`aelastic.store.wire`, the codec, where its users find it). The store's hot path.

Nothing here touches a socket, a clock or a logger.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import partial
from typing import Final, cast

from ..errors import StoreProtocolError
from ._messages import (
    NEED_DATA,
    Add,
    Append,
    Barrier,
    CancelWait,
    Check,
    CompareSet,
    DeleteKey,
    Get,
    GetNumKeys,
    Limits,
    ListKeys,
    MultiGet,
    MultiSet,
    NeedData,
    Ping,
    QueryType,
    QueueLen,
    QueuePop,
    QueuePush,
    Request,
    Set,
    Validate,
    Wait,
)

__all__ = ["RequestParser"]

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class _Incomplete(Exception):
    """Raised inside a parse when the buffer ends before the request does; never escapes this module."""


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
