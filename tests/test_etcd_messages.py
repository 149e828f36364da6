"""The etcd JSON gateway's messages (``aelastic.etcd.messages``) without a server: the gateway's conventions
(base64 bytes, 64-bit integers as decimal strings, zero values left out) encoded and decoded in one place."""

from __future__ import annotations

import ast
import base64
from pathlib import Path

import pytest

from aelastic.errors import EtcdRequestError
from aelastic.etcd import messages
from aelastic.etcd.messages import (
    Compare,
    DeleteOp,
    EventType,
    Lease,
    PutOp,
    RangeOp,
    RangeResponse,
    SortOrder,
    SortTarget,
    TxnResponse,
    WatchEvent,
    prefix_range_end,
    txn_request,
    watch_create_request,
)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_requests_leave_zero_values_out_and_carry_integers_as_strings() -> None:
    assert RangeOp(b"k").to_json() == {"key": b64(b"k")}
    assert RangeOp(b"a", b"b", limit=2, count_only=True, sort_target=SortTarget.MOD, sort_order=SortOrder.ASCEND,
                   revision=9).to_json() == {
        "key": b64(b"a"), "range_end": b64(b"b"), "revision": "9", "limit": "2", "count_only": True,
        "sort_order": "ASCEND", "sort_target": "MOD",
    }  # fmt: skip
    assert PutOp(b"k", b"", lease=7).to_json() == {"key": b64(b"k"), "value": "", "lease": "7"}
    assert DeleteOp(b"a", b"b", prev_kv=True).to_json() == {"key": b64(b"a"), "range_end": b64(b"b"), "prev_kv": True}
    assert Compare.mod_revision(b"k", 0).to_json() == {
        "key": b64(b"k"), "target": "MOD", "result": "EQUAL", "mod_revision": "0",
    }  # fmt: skip


def test_txn_and_watch_bodies() -> None:
    body = txn_request([Compare.version(b"k", 0)], [PutOp(b"k", b"v")], [RangeOp(b"k")])
    assert body["success"] == [{"request_put": {"key": b64(b"k"), "value": b64(b"v")}}]
    assert body["failure"] == [{"request_range": {"key": b64(b"k")}}]
    assert watch_create_request(b"/p", prefix_range_end(b"/p"), 0) == {
        "create_request": {"key": b64(b"/p"), "range_end": b64(b"/q")}
    }
    assert watch_create_request(b"k", None, 12) == {"create_request": {"key": b64(b"k"), "start_revision": "12"}}


def test_prefix_range_end() -> None:
    assert (prefix_range_end(b"a\xff"), prefix_range_end(b"\xff\xff"), prefix_range_end(b"")) == (b"b", b"\0", b"\0")


def test_answers_decode_absent_fields_as_zero_values() -> None:
    kv = {"key": b64(b"k"), "value": b64(b"v"), "mod_revision": "5"}
    response = RangeResponse.from_json({"header": {"revision": "6"}, "kvs": [kv], "count": "1"})
    assert (response.revision, response.count, response.more, response.kvs[0].version) == (6, 1, False, 0)
    assert WatchEvent.from_json({"kv": kv}).type is EventType.PUT  # PUT is the zero value: the field is left out
    assert WatchEvent.from_json({"type": "DELETE", "kv": {"key": b64(b"k")}}).kv.value == b""
    assert Lease.from_json({"ID": "42", "TTL": "3"}) == Lease(42, 3)
    txn = TxnResponse.from_json({"header": {"revision": "3"}, "responses": [{"response_put": {}}]})
    assert (txn.succeeded, txn.revision) == (False, 3)
    with pytest.raises(EtcdRequestError, match="is PutResponse, not a range"):
        txn.range(0)
    with pytest.raises(EtcdRequestError, match="did not send"):
        TxnResponse.from_json({"responses": [{"response_surprise": {}}]})


def test_messages_perform_no_io() -> None:
    # aelastic.etcd's __init__ imports the client (h11), so the check reads the module's own imports.
    tree = ast.parse(Path(messages.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "base64", "enum", "collections.abc", "dataclasses", "typing", "errors"}, imported
