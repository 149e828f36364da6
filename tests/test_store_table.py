"""The store server's sans-IO core (``aelastic.store.table``) driven without a socket or an event loop: bytes in,
replies in the outbox, wake-ups through ``notify``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aelastic.errors import StoreProtocolError
from aelastic.store import wire
from aelastic.store._handshake import HandshakeDeadlines
from aelastic.store.table import Connection, Refused, StoreTable


class Peer(Connection):
    """A connection whose transport only records what the core asked of it."""

    __slots__ = ("aborted", "lingered", "notified")

    def __init__(self, table: StoreTable) -> None:
        super().__init__(table.limits, "peer")
        self.notified = 0
        self.aborted = False
        self.lingered = False

    def notify(self) -> None:
        self.notified += 1

    def abort(self) -> None:
        self.aborted = True

    def linger(self) -> None:
        self.lingered = True


@pytest.mark.parametrize(
    ("error", "lingered", "aborted"),
    [
        (Refused("wrong token"), True, False),  # the auth CHECK's NOT_READY first, then closed
        (StoreProtocolError("bad request"), False, True),
        (KeyError("a bug"), False, True),  # logged with its traceback (Connection.fail)
    ],
)
def test_how_a_connection_whose_handling_raised_ends(error: Exception, lingered: bool, aborted: bool) -> None:
    """One rule for every transport (``Connection.end``); each only says how it closes (``abort``, ``linger``)."""
    peer = Peer(new_table())
    try:
        raise error
    except Exception as exc:
        peer.end(exc)
    assert (peer.lingered, peer.aborted) == (lingered, aborted)


def new_table(*, max_buffered_bytes: int = 1 << 20, max_connections: int = 4) -> StoreTable:
    return StoreTable(
        wire.Limits(), max_buffered_bytes=max_buffered_bytes, max_connections=max_connections, auth_token=None, port=0
    )


def connect(table: StoreTable) -> Peer:
    peer = Peer(table)
    assert table.admit(peer)
    feed(table, peer, wire.encode_request(wire.Validate()))
    return peer


def feed(table: StoreTable, peer: Peer, data: bytes) -> bytes:
    """Hand ``data`` to the core as a transport would; the replies it queued (taken out of the outbox)."""
    table.receive(peer, data)
    while table.process(peer):
        pass
    table.check_buffered(peer)
    replies = bytes(peer.outbox)
    peer.outbox.clear()
    return replies


@pytest.mark.parametrize("chunk", [None, 1], ids=["whole", "byte-by-byte"])
def test_requests_in_replies_out(chunk: int | None) -> None:
    table = new_table()
    peer = connect(table)
    data = b"".join(map(wire.encode_request, [wire.Set(b"k", b"v"), wire.Get(b"k"), wire.Add(b"n", 3), wire.Ping(9)]))
    pieces = [data] if chunk is None else [data[i : i + chunk] for i in range(len(data))]
    replies = b"".join(feed(table, peer, piece) for piece in pieces)
    assert replies == b"\x01\x00\x00\x00\x00\x00\x00\x00v" + (3).to_bytes(8, "little") + (9).to_bytes(4, "little")
    assert (table.key_count(), table.ops, table.ops_by_kind["Set"]) == (2, 5, 1)


def test_a_set_wakes_the_waiter_through_notify() -> None:
    table = new_table()
    waiter, setter = connect(table), connect(table)
    assert feed(table, waiter, wire.encode_request(wire.Wait((b"a", b"b")))) == b""
    assert table.waiter_count() == 1
    feed(table, setter, wire.encode_request(wire.Set(b"a", b"1")))
    assert (waiter.outbox, waiter.notified) == (bytearray(), 0)  # one of two keys: still waiting
    feed(table, setter, wire.encode_request(wire.Set(b"b", b"2")))
    assert (bytes(waiter.outbox), waiter.notified) == (bytes((wire.WaitResponse.STOP_WAITING,)), 1)
    assert table.waiter_count() == 0


def test_drop_forgets_the_registrations_and_admit_caps_connections() -> None:
    table = new_table(max_connections=1)
    peer = connect(table)
    feed(table, peer, wire.encode_request(wire.Wait((b"never",))))
    assert not table.admit(Peer(table))
    table.drop(peer)
    assert (table.waiter_count(), len(table.connections)) == (0, 0)
    assert table.admit(Peer(table))


def test_first_request_must_be_validate() -> None:
    table = new_table()
    peer = Peer(table)
    table.admit(peer)
    with pytest.raises(StoreProtocolError, match="first request is Ping, not VALIDATE"):
        feed(table, peer, wire.encode_request(wire.Ping(1)))


def test_unsent_wake_ups_beyond_the_limit_abort_the_woken_connection() -> None:
    table = new_table(max_buffered_bytes=4096)
    peer = connect(table)
    peer.outbox += b"x" * 4096  # replies its peer has not read
    table.deliver(peer, bytes((wire.WaitResponse.STOP_WAITING,)))
    assert (peer.aborted, peer.notified) == (True, 0)


def test_handshake_deadlines_close_the_late_in_order_and_arm_one_timer(caplog: pytest.LogCaptureFixture) -> None:
    table = new_table(max_connections=8)
    deadlines = HandshakeDeadlines(table, timeout=1.0)

    def arrive() -> Peer:
        peer = Peer(table)
        assert table.admit(peer)
        return peer

    early, done, gone, late = (arrive() for _ in range(4))
    assert deadlines.add(early, now=0.0) == 1.0  # the first pending deadline: the transport arms its timer for it
    assert deadlines.add(done, now=0.1) is None  # behind it: the timer is armed already
    assert deadlines.add(gone, now=0.2) is None
    assert deadlines.add(late, now=0.5) is None
    done.establish()
    table.drop(gone)  # closed by its peer meanwhile
    assert deadlines.expire(now=0.9) == 1.0  # a timer that fires early closes nothing
    assert not early.aborted
    assert deadlines.expire(now=1.3) == 1.5
    assert [c.aborted for c in (early, done, gone, late)] == [True, False, False, False]
    assert caplog.text.count("no VALIDATE within 1s") == 1
    assert deadlines.expire(now=1.5) is None
    assert late.aborted
    assert deadlines.add(arrive(), now=2.0) == 3.0  # nothing pending: arm again


@pytest.mark.parametrize("module", ["aelastic.store.table", "aelastic.store._handshake"])
def test_the_core_imports_no_event_loop_and_no_socket(module: str) -> None:
    code = f"import sys, {module}\nprint(sorted(m for m in ('anyio', 'asyncio', 'trio', 'socket') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
