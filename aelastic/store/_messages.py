"""The messages of torch's TCPStore wire protocol: query types, typed requests and replies, the limits.

Re-exported by :mod:`aelastic.store.wire` (the codec), where every user imports them from.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, NamedTuple

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
    "Set",
    "Validate",
    "ValueReply",
    "ValuesReply",
    "Wait",
    "WaitReply",
    "WaitResponse",
]

VALIDATION_MAGIC: Final = 0x3C85F7CE


class QueryType(enum.IntEnum):
    """The query byte that opens every request (torch ``store/TCPStoreBackend.hpp``)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


class CheckResponse(enum.IntEnum):
    READY = 0
    NOT_READY = 1


class WaitResponse(enum.IntEnum):
    STOP_WAITING = 0
    WAIT_CANCELED = 1


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request limits; the defaults are torch's libuv server's (``TCPStoreLibUvBackend.cpp``)."""

    max_key_length: int = 8 * 1024
    max_value_length: int = 8 * 1024 * 1024
    max_keys_per_request: int = 128 * 1024

    def __post_init__(self) -> None:
        for name in ("max_key_length", "max_value_length", "max_keys_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name}={getattr(self, name)!r}: must be >= 1")


# --- requests -------------------------------------------------------------------------------------------------
# Messages are NamedTuples: immutable and cheap to build on the server's hot path (one request object per SET; a frozen
# dataclass sets each field through object.__setattr__, as costly as parsing the request), and cheap to define (a
# dataclass per message would weigh on every launch's import). Being tuples, two messages of different types with equal
# fields compare equal: the code dispatches on type (match, isinstance), never on ==.


class Validate(NamedTuple):
    magic: int = VALIDATION_MAGIC


class Set(NamedTuple):
    key: bytes
    value: bytes


class CompareSet(NamedTuple):
    key: bytes
    expected: bytes
    desired: bytes


class Get(NamedTuple):
    key: bytes


class Add(NamedTuple):
    key: bytes
    delta: int


class Check(NamedTuple):
    keys: tuple[bytes, ...]


class Wait(NamedTuple):
    keys: tuple[bytes, ...]


class GetNumKeys(NamedTuple):
    pass


class DeleteKey(NamedTuple):
    key: bytes


class Append(NamedTuple):
    key: bytes
    value: bytes


class MultiGet(NamedTuple):
    keys: tuple[bytes, ...]


class MultiSet(NamedTuple):
    items: tuple[tuple[bytes, bytes], ...]


class CancelWait(NamedTuple):
    pass


class Ping(NamedTuple):
    nonce: int


class QueuePush(NamedTuple):
    key: bytes
    value: bytes


class QueuePop(NamedTuple):
    key: bytes


class QueueLen(NamedTuple):
    key: bytes


class ListKeys(NamedTuple):
    pass


class Barrier(NamedTuple):
    key: bytes
    world_size: int


Request = (
    Validate | Set | CompareSet | Get | Add | Check | Wait | GetNumKeys | DeleteKey | Append | MultiGet | MultiSet
    | CancelWait | Ping | QueuePush | QueuePop | QueueLen | ListKeys | Barrier
)  # fmt: skip


# --- replies --------------------------------------------------------------------------------------------------


class ValueReply(NamedTuple):
    """Reply to GET and COMPARE_SET."""

    value: bytes


class IntReply(NamedTuple):
    """Reply to ADD, GETNUMKEYS, DELETE_KEY and QUEUE_LEN."""

    value: int


class CheckReply(NamedTuple):
    response: CheckResponse


class WaitReply(NamedTuple):
    """Reply to WAIT, BARRIER and CANCEL_WAIT."""

    response: WaitResponse


class PingReply(NamedTuple):
    nonce: int


class ValuesReply(NamedTuple):
    """Reply to MULTI_GET: one value per requested key, in order."""

    values: tuple[bytes, ...]


class QueuePopReply(NamedTuple):
    """Reply to QUEUE_POP: the queue length before the pop, and the popped value if there was one."""

    length: int
    value: bytes | None


class KeysReply(NamedTuple):
    """Reply to LIST_KEYS: every raw key of the store."""

    keys: tuple[bytes, ...]


Reply = ValueReply | IntReply | CheckReply | WaitReply | PingReply | ValuesReply | QueuePopReply | KeysReply


class NeedData(enum.Enum):
    """The buffered bytes do not yet hold a whole message."""

    NEED_DATA = enum.auto()


NEED_DATA: Final = NeedData.NEED_DATA
