"""The sans-IO TCPStore codec: requests and replies whole, one byte at a time, with trailing bytes, and fuzzed."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aelastic.errors import StoreProtocolError
from aelastic.store import wire

REQUESTS: list[wire.Request] = [
    wire.Validate(),
    wire.Set(b"/k", b"v"),
    wire.Set(b"/empty", b""),
    wire.CompareSet(b"/k", b"", b"new"),
    wire.Get(b"/k"),
    wire.Add(b"/n", -7),
    wire.Check((b"/a", b"/b")),
    wire.Wait((b"/a",)),
    wire.Wait(()),
    wire.GetNumKeys(),
    wire.DeleteKey(b"/k"),
    wire.Append(b"/k", b"more"),
    wire.MultiGet((b"/a", b"/b", b"/c")),
    wire.MultiSet(((b"/a", b"1"), (b"/b", b"2"))),
    wire.CancelWait(),
    wire.Ping(0xDEADBEEF),
    wire.QueuePush(b"/q", b"item"),
    wire.QueuePop(b"/q"),
    wire.QueueLen(b"/q"),
    wire.ListKeys(),
    wire.Barrier(b"/bar", 4),
]

# (request that asks, reply that answers it)
EXCHANGES: list[tuple[wire.Request, wire.Reply]] = [
    (wire.CompareSet(b"/k", b"", b"x"), wire.ValueReply(b"x")),
    (wire.Get(b"/k"), wire.ValueReply(b"\x00" * 300)),
    (wire.Add(b"/n", 1), wire.IntReply(-(2**63))),
    (wire.GetNumKeys(), wire.IntReply(12)),
    (wire.DeleteKey(b"/k"), wire.IntReply(1)),
    (wire.QueueLen(b"/q"), wire.IntReply(0)),
    (wire.Check((b"/a",)), wire.CheckReply(wire.CheckResponse.NOT_READY)),
    (wire.Wait((b"/a",)), wire.WaitReply(wire.WaitResponse.STOP_WAITING)),
    (wire.Barrier(b"/b", 2), wire.WaitReply(wire.WaitResponse.STOP_WAITING)),
    (wire.Ping(7), wire.PingReply(7)),
    (wire.MultiGet((b"/a", b"/b")), wire.ValuesReply((b"1", b""))),
    (wire.QueuePop(b"/q"), wire.QueuePopReply(2, b"front")),
    (wire.QueuePop(b"/q"), wire.QueuePopReply(0, None)),
    (wire.ListKeys(), wire.KeysReply((b"/a", b"init/"))),
]


def typed(messages: Sequence[object]) -> list[tuple[type, object]]:
    """Messages are NamedTuples, equal across types when their fields are: compare the types too."""
    return [(type(m), m) for m in messages]


def parse_requests(data: bytes, chunk: int, limits: wire.Limits | None = None) -> list[wire.Request]:
    parser = wire.RequestParser(limits)
    out: list[wire.Request] = []
    for i in range(0, len(data), chunk):
        parser.receive_data(data[i : i + chunk])
        while (request := parser.next_request()) is not wire.NEED_DATA:
            out.append(request)
    return out


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_request_round_trip(request_: wire.Request, chunk: int) -> None:
    assert typed(parse_requests(wire.encode_request(request_), chunk)) == typed([request_])


def test_all_requests_back_to_back_one_byte_at_a_time() -> None:
    data = b"".join(map(wire.encode_request, REQUESTS))
    assert typed(parse_requests(data, 1)) == typed(REQUESTS)


@pytest.mark.parametrize("chunk", [1, 7, 1440, 4097, 1 << 20])
def test_large_requests_between_small_ones_any_chunking(chunk: int) -> None:
    """The parser buffers the received bytes objects and switches to a growing bytearray for a partial request
    over 4 KiB, and back: every chunking gives the same requests."""
    big = bytes(range(256)) * 800  # 200 KiB
    requests: list[wire.Request] = [
        wire.Set(b"/a", b"1"),
        wire.Set(b"/big", big),
        wire.Get(b"/a"),
        wire.MultiSet(((b"/x", big[:5000]), (b"/y", b""))),
        wire.Ping(3),
    ]
    data = b"".join(map(wire.encode_request, requests))
    assert typed(parse_requests(data, chunk)) == typed(requests)


def test_request_not_consumed_until_complete() -> None:
    data = wire.encode_request(wire.Set(b"/key", b"value"))
    parser = wire.RequestParser()
    parser.receive_data(data[:-1])
    assert parser.next_request() is wire.NEED_DATA
    assert parser.buffered == len(data) - 1
    parser.receive_data(data[-1:])
    assert typed([parser.next_request()]) == typed([wire.Set(b"/key", b"value")])
    assert parser.buffered == 0


def test_trailing_bytes_stay_buffered() -> None:
    first = wire.encode_request(wire.Get(b"/a"))
    partial = wire.encode_request(wire.Get(b"/bcd"))[:5]
    parser = wire.RequestParser()
    parser.receive_data(first + partial)
    assert typed([parser.next_request()]) == typed([wire.Get(b"/a")])
    assert parser.next_request() is wire.NEED_DATA
    assert parser.buffered == len(partial)


def test_torch_handshake_bytes() -> None:
    # What torch's client sends first (spec §1.4): VALIDATE with the magic, then PING with its pid.
    assert wire.encode_request(wire.Validate()) == b"\x00\xce\xf7\x85\x3c"
    assert wire.encode_request(wire.Ping(0x01020304)) == b"\x0d\x04\x03\x02\x01"
    assert wire.encode_request(wire.Add(b"init/", 1)) == b"\x04" + struct.pack("<Q", 5) + b"init/" + struct.pack(
        "<q", 1
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x63", "unknown query type 99"),
        (b"\x01" + struct.pack("<Q", 9000) + b"k", "key of 9000 bytes exceeds the limit of 8192 bytes"),
        (b"\x01" + struct.pack("<Q", 1) + b"k" + struct.pack("<Q", 2**63), "value of 9223372036854775808 bytes"),
        (b"\x06" + struct.pack("<Q", 2**64 - 1), "request names 18446744073709551615 keys"),
        (b"\x0b" + struct.pack("<q", -1), "request names -1 keys"),
    ],
)
def test_malformed_and_absurd_requests_are_refused_early(data: bytes, message: str) -> None:
    parser = wire.RequestParser()
    parser.receive_data(data)
    with pytest.raises(StoreProtocolError, match=message):
        parser.next_request()


def test_limits_are_settings() -> None:
    limits = wire.Limits(max_key_length=4, max_value_length=4, max_keys_per_request=2)
    with pytest.raises(StoreProtocolError, match="value of 5 bytes exceeds the limit of 4"):
        parse_requests(wire.encode_request(wire.Set(b"/k", b"12345")), 64, limits)
    with pytest.raises(StoreProtocolError, match="3 keys"):
        parse_requests(wire.encode_request(wire.MultiGet((b"/a", b"/b", b"/c"))), 64, limits)
    with pytest.raises(ValueError, match="max_key_length=0"):
        wire.Limits(max_key_length=0)


def client_replies(exchanges: list[tuple[wire.Request, wire.Reply]], chunk: int) -> list[wire.Reply]:
    client = wire.ClientProtocol()
    for request, _ in exchanges:
        client.send(request)
    data = b"".join(wire.encode_reply(reply) for _, reply in exchanges)
    out: list[wire.Reply] = []
    for i in range(0, len(data), chunk):
        client.receive_data(data[i : i + chunk])
        while (reply := client.next_reply()) is not wire.NEED_DATA:
            out.append(reply)
    return out


@pytest.mark.parametrize("chunk", [1, 2, 7, 1 << 20])
def test_replies_in_order_any_chunking(chunk: int) -> None:
    assert typed(client_replies(EXCHANGES, chunk)) == typed([reply for _, reply in EXCHANGES])


def test_reply_less_requests_expect_nothing() -> None:
    client = wire.ClientProtocol()
    for request in (wire.Validate(), wire.Set(b"/a", b"1"), wire.Append(b"/a", b"2"), wire.QueuePush(b"/q", b"")):
        client.send(request)
    assert client.pending == 0
    client.receive_data(b"\x00")
    with pytest.raises(StoreProtocolError, match="nobody asked for"):
        client.next_reply()


def test_cancelled_wait_when_server_cancels() -> None:
    """Server had not answered the WAIT: it sends only WAIT_CANCELED, which answers both requests."""
    client = wire.ClientProtocol()
    client.send(wire.Wait((b"/k",)))
    client.send(wire.CancelWait())
    client.receive_data(b"\x01")
    canceled = wire.WaitReply(wire.WaitResponse.WAIT_CANCELED)
    assert typed([client.next_reply(), client.next_reply()]) == typed([canceled, canceled])
    assert client.pending == 0
    assert client.next_reply() is wire.NEED_DATA


def test_cancelled_wait_that_raced_the_key() -> None:
    """The key arrived before the cancel: STOP_WAITING answers the WAIT, WAIT_CANCELED the cancel."""
    client = wire.ClientProtocol()
    client.send(wire.Barrier(b"/b", 2))
    client.send(wire.CancelWait())
    client.receive_data(b"\x00\x01")
    assert typed([client.next_reply(), client.next_reply()]) == typed(
        [wire.WaitReply(wire.WaitResponse.STOP_WAITING), wire.WaitReply(wire.WaitResponse.WAIT_CANCELED)]
    )
    assert client.pending == 0


def test_cancel_without_wait_is_refused() -> None:
    with pytest.raises(StoreProtocolError, match="no WAIT or BARRIER is outstanding"):
        wire.ClientProtocol().send(wire.CancelWait())


def test_bad_reply_bytes() -> None:
    client = wire.ClientProtocol()
    client.send(wire.Check((b"/a",)))
    client.receive_data(b"\x05")
    with pytest.raises(StoreProtocolError, match="reply byte 5 is not a CheckResponse"):
        client.next_reply()
    client = wire.ClientProtocol()
    client.send(wire.Wait((b"/a",)))
    client.receive_data(b"\x01")
    with pytest.raises(StoreProtocolError, match="cancelled a wait that was not cancelled"):
        client.next_reply()


# --- property-based ---------------------------------------------------------------------------------------------

keys = st.binary(max_size=40)
values = st.binary(max_size=200)
i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
requests = st.one_of(
    st.builds(wire.Validate, st.integers(0, 2**32 - 1)),
    st.builds(wire.Set, keys, values),
    st.builds(wire.CompareSet, keys, values, values),
    st.builds(wire.Get, keys),
    st.builds(wire.Add, keys, i64),
    st.builds(wire.Check, st.lists(keys, max_size=5).map(tuple)),
    st.builds(wire.Wait, st.lists(keys, max_size=5).map(tuple)),
    st.just(wire.GetNumKeys()),
    st.builds(wire.DeleteKey, keys),
    st.builds(wire.Append, keys, values),
    st.builds(wire.MultiGet, st.lists(keys, max_size=5).map(tuple)),
    st.builds(wire.MultiSet, st.lists(st.tuples(keys, values), max_size=5).map(tuple)),
    st.just(wire.CancelWait()),
    st.builds(wire.Ping, st.integers(0, 2**32 - 1)),
    st.builds(wire.QueuePush, keys, values),
    st.builds(wire.QueuePop, keys),
    st.builds(wire.QueueLen, keys),
    st.just(wire.ListKeys()),
    st.builds(wire.Barrier, keys, i64),
)


@given(st.lists(requests, max_size=12), st.integers(1, 64))
def test_any_request_sequence_round_trips(reqs: list[wire.Request], chunk: int) -> None:
    data = b"".join(map(wire.encode_request, reqs))
    assert typed(parse_requests(data, chunk)) == typed(reqs)


@given(st.lists(st.one_of(requests, st.builds(wire.Set, keys, values)), max_size=16), st.integers(1, 64))
def test_runs_of_sets_stored_straight_into_a_table_as_parsed(reqs: list[wire.Request], chunk: int) -> None:
    """``store_sets`` (the server's SET-flood path) takes exactly the SETs that ``next_request`` would have
    returned next, in order, and leaves everything else to it, for any chunking."""
    data = b"".join(map(wire.encode_request, reqs))
    parser = wire.RequestParser()
    table: dict[bytes, bytes] = {}
    others: list[wire.Request] = []  # what next_request returned besides SETs
    for i in range(0, len(data), chunk):
        parser.receive_data(data[i : i + chunk])
        while True:
            parser.store_sets(table)
            request = parser.next_request()
            if request is wire.NEED_DATA:
                break
            if isinstance(request, wire.Set):
                table[request.key] = request.value
            else:
                others.append(request)
    expected = {r.key: r.value for r in reqs if isinstance(r, wire.Set)}
    assert table == expected
    assert typed(others) == typed([r for r in reqs if not isinstance(r, wire.Set)])
    assert parser.buffered == 0


def test_a_set_over_the_value_limit_is_left_to_next_request() -> None:
    limits = wire.Limits(max_value_length=4)
    parser = wire.RequestParser(limits)
    parser.receive_data(b"".join(map(wire.encode_request, [wire.Set(b"/a", b"1"), wire.Set(b"/b", b"too long")])))
    table: dict[bytes, bytes] = {}
    assert parser.store_sets(table) == 1
    assert table == {b"/a": b"1"}
    with pytest.raises(StoreProtocolError, match="value"):
        parser.next_request()


def test_a_set_not_yet_whole_waits_for_its_bytes() -> None:
    frames = [wire.encode_request(wire.Set(b"/k%d" % i, b"v" * i)) for i in range(3)]
    data = b"".join(frames)
    parser = wire.RequestParser()
    parser.receive_data(data[:-1])
    table: dict[bytes, bytes] = {}
    assert parser.store_sets(table) == 2
    assert parser.buffered == len(frames[2]) - 1
    parser.receive_data(data[-1:])
    assert parser.store_sets(table) == 1
    assert table == {b"/k0": b"", b"/k1": b"v", b"/k2": b"vv"}
    assert parser.buffered == 0


@settings(max_examples=300)
@given(st.binary(max_size=300), st.integers(1, 32))
def test_random_bytes_never_crash_the_parser(data: bytes, chunk: int) -> None:
    """Random input yields requests, NEED_DATA or StoreProtocolError, never anything else."""
    limits = wire.Limits(max_key_length=64, max_value_length=256, max_keys_per_request=8)
    with contextlib.suppress(StoreProtocolError):
        parse_requests(data, chunk, limits)


@settings(max_examples=300)
@given(st.lists(requests, min_size=1, max_size=6), st.data())
def test_mutated_frames_never_crash_the_parser(reqs: list[wire.Request], data: st.DataObject) -> None:
    frame = bytearray(b"".join(map(wire.encode_request, reqs)))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    try:
        parsed = parse_requests(bytes(frame[:cut]), 5)
    except StoreProtocolError:
        return
    # Whatever parsed must re-encode to a prefix of the input: nothing invented, nothing skipped.
    assert bytes(frame[:cut]).startswith(b"".join(map(wire.encode_request, parsed)))
