"""The etcd v3 JSON gateway's messages as frozen value types: requests encode themselves, responses decode once.

The gateway speaks JSON: keys and values are base64, 64-bit integers travel as decimal strings, and fields at their
zero value are left out (a PUT event has no ``type``, a failed txn no ``succeeded``). Each request type here has a
``to_json`` and each response type a ``from_json`` that turn those conventions into Python values in one place, so
the client (:mod:`aelastic.etcd.client`) only moves dictionaries. Nothing here performs I/O.
"""

from __future__ import annotations

import base64
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from ..errors import EtcdRequestError

__all__ = [
    "Compare",
    "CompareResult",
    "CompareTarget",
    "DeleteOp",
    "DeleteRangeResponse",
    "EventType",
    "KeyValue",
    "Lease",
    "Member",
    "Op",
    "OpResponse",
    "PutOp",
    "PutResponse",
    "RangeOp",
    "RangeResponse",
    "SortOrder",
    "SortTarget",
    "TxnResponse",
    "WatchEvent",
    "b64",
    "int_field",
    "key_range",
    "members_of",
    "prefix_range_end",
    "txn_request",
    "watch_create_request",
]


def b64(data: bytes) -> str:
    """``data`` as the gateway's JSON carries bytes."""
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def int_field(obj: dict[str, Any], name: str) -> int:
    """The integer field ``name`` of a gateway answer: a decimal string, or absent at its zero value."""
    return int(obj.get(name) or 0)


def key_range(key: bytes, range_end: bytes | None) -> dict[str, Any]:
    """The ``key`` (and ``range_end``, if any) fields that every ranged request carries."""
    body: dict[str, Any] = {"key": b64(key)}
    if range_end is not None:
        body["range_end"] = b64(range_end)
    return body


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix`` (etcdctl's ``--prefix``)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


# --- values -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> KeyValue:
        return cls(
            _unb64(obj.get("key")), _unb64(obj.get("value")), int_field(obj, "create_revision"),
            int_field(obj, "mod_revision"), int_field(obj, "version"), int_field(obj, "lease"),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class RangeResponse:
    revision: int  # the store revision this read saw
    kvs: tuple[KeyValue, ...]
    count: int
    more: bool = False

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RangeResponse:
        kvs = tuple(KeyValue.from_json(kv) for kv in obj.get("kvs", ()))
        return cls(int_field(obj.get("header", {}), "revision"), kvs, int_field(obj, "count"), bool(obj.get("more")))


@dataclass(frozen=True, slots=True)
class PutResponse:
    revision: int
    prev_kv: KeyValue | None = None

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> PutResponse:
        prev = obj.get("prev_kv")
        return cls(int_field(obj.get("header", {}), "revision"), KeyValue.from_json(prev) if prev else None)


@dataclass(frozen=True, slots=True)
class DeleteRangeResponse:
    revision: int
    deleted: int
    prev_kvs: tuple[KeyValue, ...] = ()

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DeleteRangeResponse:
        prev = tuple(KeyValue.from_json(kv) for kv in obj.get("prev_kvs", ()))
        return cls(int_field(obj.get("header", {}), "revision"), int_field(obj, "deleted"), prev)


OpResponse = RangeResponse | PutResponse | DeleteRangeResponse


@dataclass(frozen=True, slots=True)
class TxnResponse:
    revision: int
    succeeded: bool
    responses: tuple[OpResponse, ...]

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TxnResponse:
        responses: list[OpResponse] = []
        for item in obj.get("responses", ()):
            if "response_range" in item:
                responses.append(RangeResponse.from_json(item["response_range"]))
            elif "response_put" in item:
                responses.append(PutResponse.from_json(item["response_put"]))
            elif "response_delete_range" in item:
                responses.append(DeleteRangeResponse.from_json(item["response_delete_range"]))
            else:
                raise EtcdRequestError(f"etcd txn answered an operation this client did not send: {item!r}")
        return cls(int_field(obj.get("header", {}), "revision"), bool(obj.get("succeeded")), tuple(responses))

    def range(self, index: int) -> RangeResponse:
        """The ``index``-th response, which must answer a :class:`RangeOp`."""
        response = self.responses[index]
        if not isinstance(response, RangeResponse):
            raise EtcdRequestError(f"etcd txn response {index} is {type(response).__name__}, not a range")
        return response


class EventType(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: EventType
    kv: KeyValue  # for DELETE: the key and the deletion's mod_revision; the value is empty

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> WatchEvent:
        kind = EventType.DELETE if obj.get("type") == "DELETE" else EventType.PUT  # PUT is the zero value: absent
        return cls(kind, KeyValue.from_json(obj.get("kv", {})))


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl: int

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Lease:
        return cls(int_field(obj, "ID"), int_field(obj, "TTL"))


@dataclass(frozen=True, slots=True)
class Member:
    """One member of the cluster. A member added but not started yet has no ``name`` and no ``client_urls``."""

    id: int
    name: str
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Member:
        return cls(
            int_field(obj, "ID"), str(obj.get("name") or ""), tuple(obj.get("peerURLs", ())),
            tuple(obj.get("clientURLs", ())),
        )  # fmt: skip


def members_of(obj: dict[str, Any]) -> tuple[Member, ...]:
    """The ``members`` of a member list, add or remove answer, by id."""
    return tuple(sorted((Member.from_json(m) for m in obj.get("members", ())), key=lambda m: m.id))


# --- requests -----------------------------------------------------------------------------------------------------


class CompareTarget(enum.Enum):
    VERSION = "version"
    CREATE = "create_revision"
    MOD = "mod_revision"
    VALUE = "value"
    LEASE = "lease"


class CompareResult(enum.Enum):
    EQUAL = "EQUAL"
    GREATER = "GREATER"
    LESS = "LESS"
    NOT_EQUAL = "NOT_EQUAL"


@dataclass(frozen=True, slots=True)
class Compare:
    """One txn condition. A missing key compares as version, create and mod revision 0; a VALUE compare fails."""

    key: bytes
    target: CompareTarget
    operand: int | bytes
    result: CompareResult = CompareResult.EQUAL
    range_end: bytes | None = None  # compare every key in [key, range_end) (etcd >= 3.3); no key: holds

    @classmethod
    def mod_revision(cls, key: bytes, revision: int) -> Compare:
        return cls(key, CompareTarget.MOD, revision)

    @classmethod
    def version(cls, key: bytes, version: int) -> Compare:
        return cls(key, CompareTarget.VERSION, version)

    @classmethod
    def value(cls, key: bytes, value: bytes) -> Compare:
        return cls(key, CompareTarget.VALUE, value)

    def to_json(self) -> dict[str, Any]:
        operand = b64(self.operand) if isinstance(self.operand, bytes) else str(self.operand)
        body = {
            "key": b64(self.key),
            "target": self.target.name,
            "result": self.result.value,
            self.target.value: operand,
        }
        if self.range_end is not None:
            body["range_end"] = b64(self.range_end)
        return body


class SortTarget(enum.Enum):
    KEY = "KEY"
    VERSION = "VERSION"
    CREATE = "CREATE"
    MOD = "MOD"
    VALUE = "VALUE"


class SortOrder(enum.Enum):
    NONE = "NONE"
    ASCEND = "ASCEND"
    DESCEND = "DESCEND"


@dataclass(frozen=True, slots=True)
class RangeOp:
    key: bytes
    range_end: bytes | None = None
    limit: int = 0
    keys_only: bool = False
    count_only: bool = False
    sort_target: SortTarget = SortTarget.KEY
    sort_order: SortOrder = SortOrder.NONE
    revision: int = 0  # read the store as it was at this revision; 0: as it is now
    serializable: bool = False  # the answering member's own copy, maybe behind: no leader needed, no quorum read

    def to_json(self) -> dict[str, Any]:
        body = key_range(self.key, self.range_end)
        if self.serializable:
            body["serializable"] = True
        if self.revision:
            body["revision"] = str(self.revision)
        if self.limit:
            body["limit"] = str(self.limit)
        if self.keys_only:
            body["keys_only"] = True
        if self.count_only:
            body["count_only"] = True
        if self.sort_order is not SortOrder.NONE:
            body["sort_order"] = self.sort_order.value
            body["sort_target"] = self.sort_target.value
        return body


@dataclass(frozen=True, slots=True)
class PutOp:
    key: bytes
    value: bytes
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": b64(self.key), "value": b64(self.value)}
        if self.lease:
            body["lease"] = str(self.lease)
        return body


@dataclass(frozen=True, slots=True)
class DeleteOp:
    key: bytes
    range_end: bytes | None = None
    prev_kv: bool = False

    def to_json(self) -> dict[str, Any]:
        body = key_range(self.key, self.range_end)
        if self.prev_kv:
            body["prev_kv"] = True
        return body


Op = RangeOp | PutOp | DeleteOp
_OP_NAMES: Final = {RangeOp: "request_range", PutOp: "request_put", DeleteOp: "request_delete_range"}


def txn_request(compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op]) -> dict[str, Any]:
    """The body of ``/v3/kv/txn``."""
    return {
        "compare": [c.to_json() for c in compare],
        "success": [{_OP_NAMES[type(op)]: op.to_json()} for op in success],
        "failure": [{_OP_NAMES[type(op)]: op.to_json()} for op in failure],
    }


def watch_create_request(
    key: bytes, range_end: bytes | None, start_revision: int, *, progress_notify: bool = False
) -> dict[str, Any]:
    """The body of ``/v3/watch`` that opens a watch of ``key`` (or ``[key, range_end)``) from ``start_revision``
    (0: from now); ``progress_notify``: the server sends an empty message at its progress interval, too."""
    create = key_range(key, range_end)
    if start_revision:
        create["start_revision"] = str(start_revision)
    if progress_notify:
        create["progress_notify"] = True
    return {"create_request": create}
