"""``aelastic status`` and the live rendezvous line of ``aelastic run``.

The view is a pure function of (state, settings, a node's timers and clock), tested on tables. The command is
tested against a live two-node c10d rendezvous whose agents are real ``aelastic run`` processes: first waiting
(one agent of min 2 joined), then complete (both joined, workers running and held by the test). The live line is
checked on a pseudo-terminal, and checked absent when stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.text import TextReceiveStream

from aelastic.errors import ConfigurationError
from aelastic.rendezvous import registry
from aelastic.rendezvous.api import JoinObserver, RendezvousHandler, RendezvousParameters
from aelastic.rendezvous.backends.base import RendezvousBackend, StateReader, Versioned
from aelastic.rendezvous.backends.store import StoreBackend
from aelastic.rendezvous.codec import encode_state
from aelastic.rendezvous.dynamic import DynamicRendezvousHandler
from aelastic.rendezvous.known import state_of
from aelastic.rendezvous.registry import open_rendezvous, register_backend
from aelastic.rendezvous.values import NodeDesc, NodeTimers, RendezvousSettings, RendezvousState
from aelastic.status import LIST_LIMIT, Watch, check_readable, command, describe, waiting_reason
from aelastic.store.client import open_store_client
from aelastic.store.server import open_store_server

TESTS = Path(__file__).parent
PROBE = str(TESTS / "cli_probe.py")
DEADLINE = 90.0  # seconds for a step that involves starting processes on a loaded machine

A, B, C, D = (NodeDesc(f"10.0.0.{i}", 100 + i, 0) for i in range(1, 5))
V6 = NodeDesc("fe80::7", 7, 1)


def settings(low: int, high: int, last_call: float = 30.0) -> RendezvousSettings:
    return RendezvousSettings("job", low, high, last_call_timeout=last_call)


# --- the pure view -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "rdzv", "timers", "now", "reason"),
    [
        (None, settings(2, 2), None, None, "waiting for 2 more nodes (have 0, min 2)"),
        (RendezvousState(participants=(A,)), settings(2, 4), None, None, "waiting for 1 more node (have 1, min 2)"),
        (RendezvousState(participants=(A, B)), settings(2, 4), None, None,
         "last call: completes up to last_call_timeout=30s after min_nodes joined (have 2, min 2, max 4)"),
        (RendezvousState(round=2, participants=(A, B)), settings(2, 4), NodeTimers(1000.0, 112.2, 2), 100.0,
         "last call: completes in 13s unless 2 more nodes join first (have 2, min 2, max 4)"),
        (RendezvousState(round=2, participants=(A, B)), settings(2, 4), NodeTimers(1000.0, 112.2, 1), 100.0,
         "last call: completes up to last_call_timeout=30s after min_nodes joined (have 2, min 2, max 4)"),
        (RendezvousState(participants=(A, B, C)), settings(1, 3), None, None,
         "completing: max_nodes joined (have 3, max 3)"),
        (RendezvousState(round=3, complete=True, participants=(A, B), rank_order=(A, B)), settings(2, 2), None, None,
         "complete: round 3 runs with 2 nodes"),
        (RendezvousState(round=3, complete=True, participants=(A, B), rank_order=(A, B), wait_list=(C,),
                         redundancy_list=(D,)), settings(1, 2), None, None,
         "complete: round 3 runs with 2 nodes; 1 node waiting for the next round; 1 node in reserve"),
        (RendezvousState(round=4, closed=True), settings(1, 2), None, None,
         "closed after round 4: the job is over or was stopped; a node that joins now fails"),
        (RendezvousState(participants=(A,)), None, None, None,
         "not complete: 1 node joined (give --nnodes MIN:MAX to see what it waits for)"),
    ],
)  # fmt: skip
def test_waiting_reason(
    state: RendezvousState | None,
    rdzv: RendezvousSettings | None,
    timers: NodeTimers | None,
    now: float | None,
    reason: str,
) -> None:
    assert waiting_reason(state, rdzv, timers, now) == reason


def test_view_of_a_complete_round_has_ranks_addresses_and_lists() -> None:
    state = RendezvousState(
        round=1, complete=True, participants=(B, V6), rank_order=(B, A, V6), wait_list=(C,), redundancy_list=(D,)
    )
    view = describe(state, settings(1, 3), run_id="job", backend="c10d", endpoint="h:1")
    assert [(n.id, n.addr, n.pid, n.rank) for n in view.participants] == [
        ("10.0.0.2_102_0", "10.0.0.2", 102, 0),
        ("[fe80::7]_7_1", "fe80::7", 7, 2),  # ranks fixed at completion stay put when a member leaves
    ]
    assert [n.id for n in view.waiting] == [C.id]
    assert [n.id for n in view.reserve] == [D.id]
    assert (view.round, view.complete, view.closed, view.exists) == (1, True, False, True)
    assert view.time.last_call_seconds_left is None
    assert view.time.join_seconds_left is None
    assert "shared state holds no clock" in view.time.timing
    decoded = json.loads(json.dumps(view.to_json()))
    assert decoded["participants"][1] == {
        "id": "[fe80::7]_7_1",
        "addr": "fe80::7",
        "pid": 7,
        "rank": 2,
        "join_seconds_left": None,
    }
    assert decoded["reason"] == view.reason
    text = view.render()
    assert "rank 2" in text
    assert "fe80::7" in text
    assert "waiting for the next round (1)" in text
    assert "reserve (beyond max_nodes) (1)" in text


def test_view_inside_a_node_shows_its_own_countdowns() -> None:
    state = RendezvousState(participants=(A, B))
    view = describe(
        state,
        settings(2, 3),
        run_id="job",
        backend="c10d",
        endpoint="h:1",
        timers=NodeTimers(130.0, 110.0, 0),
        now=100.0,
    )
    assert (view.time.last_call_seconds_left, view.time.join_seconds_left) == (10.0, 30.0)
    assert view.participants[0].rank is None  # not complete: no rank yet
    assert "own deadlines" in view.time.timing
    assert "last call: 10.0s left" in view.render()


def test_watch_times_only_what_it_saw_begin() -> None:
    """The viewer's clock times a last call and a join from when it saw them begin; what began before its first
    read is not timed, and a node's next join (after its round completed) is."""
    rdzv = RendezvousSettings("job", 2, 3, last_call_timeout=30.0, join_timeout=600.0)
    watch = Watch(rdzv)
    watch.observe(RendezvousState(participants=(A, B)), now=100.0)  # mid-last-call at the first read
    assert watch.round_timers is None
    assert (watch.join_seconds_left(A, 100.0), watch.join_seconds_left(B, 100.0)) == (None, None)
    view = describe(RendezvousState(participants=(A, B)), rdzv, run_id="job", backend="c10d", endpoint="h:1",
                    watch=watch, now=100.0)  # fmt: skip
    assert view.time.last_call_seconds_left is None
    assert view.reason.startswith("last call: completes up to last_call_timeout=30s")

    watch.observe(RendezvousState(participants=(A, B, C)), now=101.0)  # C's join began before it showed
    assert watch.join_seconds_left(C, 101.0) == 600.0
    assert watch.round_timers is None  # the same last call: still untimed
    done = RendezvousState(complete=True, participants=(A, B, C), rank_order=(A, B, C))
    watch.observe(done, now=102.0)
    assert watch.join_seconds_left(C, 102.0) is None  # its join is over

    # The round's members re-join a new round: A first (below min_nodes), then B (the last call opens).
    watch.observe(RendezvousState(round=1, participants=(A,), rank_order=(A, B, C)), now=200.0)
    assert watch.join_seconds_left(A, 210.0) == 590.0
    assert watch.round_timers is not None
    assert watch.round_timers.last_call_deadline is None
    state = RendezvousState(round=1, participants=(A, B), rank_order=(A, B, C))
    watch.observe(state, now=205.0)
    view = describe(state, rdzv, run_id="job", backend="c10d", endpoint="h:1", watch=watch, now=215.0)
    assert view.time.last_call_seconds_left == 20.0
    assert view.time.clock == "viewer"
    assert view.reason == "last call: completes in 20s unless 1 more node joins first (have 2, min 2, max 3)"
    assert [p.join_seconds_left for p in view.participants] == [585.0, 590.0]
    assert "last call: at most 20.0s left" in view.render()
    assert "join: at most 585s left" in view.render()

    # A join timed from a clock reading whose float sum with the timeout overshoots it: (8.57... + 120) - 8.57...
    # is 120.00000000000001, and a time left must not exceed the timeout (a CI run read 120.00000000000011).
    fresh = Watch(RendezvousSettings("job", 2, 3, join_timeout=120.0))
    fresh.observe(RendezvousState(), now=0.0)
    now = 60 / 7
    assert (now + 120.0) - now > 120.0
    fresh.observe(RendezvousState(participants=(A,)), now=now)
    assert fresh.join_seconds_left(A, now) == 120.0

    unknown = Watch(None)  # no --nnodes: nothing can be timed
    unknown.observe(state, now=1.0)
    view = describe(state, None, run_id="job", backend="c10d", endpoint="h:1", watch=unknown, now=2.0)
    assert (view.time.last_call_seconds_left, view.time.clock) == (None, None)
    assert "give --nnodes" in view.time.timing


def test_view_of_a_run_no_node_opened() -> None:
    view = describe(None, None, run_id="nobody", backend="c10d", endpoint="h:1")
    assert not view.exists
    assert "no node has opened this run id" in view.render()


# --- against live agents -------------------------------------------------------------------------------------------


async def status(endpoint: str, run_id: str, *extra: str) -> subprocess.CompletedProcess[bytes]:
    argv = [sys.executable, "-m", "aelastic", "status", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, *extra]  # fmt: skip
    with anyio.fail_after(DEADLINE):
        return await anyio.run_process(argv, check=False)


async def wait_for_state(backend: RendezvousBackend, done: Callable[[RendezvousState], bool]) -> RendezvousState:
    """Read until ``done`` holds: woken by each write, and re-reading every 0.1 s meanwhile, since a join request
    appended to the state wakes no waiter."""
    with anyio.fail_after(DEADLINE):
        while True:
            # The store driver's reader must not block on a key no node created yet; etcd's get never blocks.
            seen = await (backend.read_state() if isinstance(backend, StoreBackend) else backend.get_state())
            state = state_of(seen)
            if done(state):
                return state
            with anyio.move_on_after(0.1):
                await backend.wait_for_change(seen)


Start = Callable[..., Awaitable[anyio.abc.Process]]


@asynccontextmanager
async def agents() -> AsyncIterator[Start]:
    """Start ``aelastic run`` processes (each in its own session); all are killed and reaped on exit."""
    started: list[anyio.abc.Process] = []

    async def start(*argv: str, env: dict[str, str], stderr: int) -> anyio.abc.Process:
        process = await anyio.open_process(
            [sys.executable, "-m", "aelastic", "run", *argv],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
        )  # fmt: skip
        started.append(process)
        return process

    try:
        yield start
    finally:
        with anyio.CancelScope(shield=True):
            for process in started:
                if process.returncode is None:
                    # asyncio's child watcher may have reaped an agent that exited on its own before this loop
                    # saw its return code: the group is then already gone.
                    with suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
                await process.aclose()


def job_flags(endpoint: str, run_id: str, nnodes: str) -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", "is_host=false,join_timeout=120"]  # fmt: skip


@pytest.mark.anyio
async def test_status_of_a_live_two_node_rendezvous_waiting_then_complete(tmp_path: Path) -> None:
    run_id = "live-status"
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(open_store_server("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{server.port}"
        backend = StoreBackend(await stack.enter_async_context(open_store_client("127.0.0.1", server.port)), run_id)
        listeners = await stack.enter_async_context(await anyio.create_tcp_listener(local_host="127.0.0.1"))
        (listener,) = listeners.listeners
        hold = f"127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        start = await stack.enter_async_context(agents())
        env = {**os.environ, "PROBE_OUT": str(tmp_path), "PROBE_HOLD": hold}
        env = {k: v for k, v in env.items() if not k.startswith("PET_")}

        # Waiting: one agent of min 2 has joined.
        first = await start(*job_flags(endpoint, run_id, "2"), PROBE, env=env, stderr=subprocess.DEVNULL)
        await wait_for_state(backend, lambda s: len(s.participants) == 1)
        result = await status(endpoint, run_id, "--nnodes", "2")
        assert result.returncode == 0, result.stderr
        text = result.stdout.decode()
        assert "status: waiting for 1 more node (have 1, min 2)" in text
        assert "round 0: not complete, open; nodes min 2, max 2" in text
        assert f"pid {first.pid}" in text
        assert "127.0.0.1" in text
        result = await status(endpoint, run_id, "--nnodes", "2", "--json")
        view = json.loads(result.stdout)
        assert view["reason"] == "waiting for 1 more node (have 1, min 2)"
        assert (view["complete"], view["closed"], view["round"]) == (False, False, 0)
        assert [(p["pid"], p["rank"], p["addr"]) for p in view["participants"]] == [(first.pid, None, "127.0.0.1")]
        assert (view["waiting"], view["reserve"]) == ([], [])
        assert view["last_call_seconds_left"] is None  # from outside a node: no clock to read it from

        # Complete: the second agent joins; both workers run (they connect to the listener) and are held there.
        second = await start(*job_flags(endpoint, run_id, "2"), PROBE, env=env, stderr=subprocess.DEVNULL)
        workers = []
        with anyio.fail_after(DEADLINE):
            while len(workers) < 2:
                workers.append(await listener.accept())
        result = await status(endpoint, run_id, "--nnodes", "2", "--json")
        view = json.loads(result.stdout)
        assert view["reason"] == "complete: round 0 runs with 2 nodes"
        assert (view["complete"], view["closed"]) == (True, False)
        assert sorted((p["rank"], p["addr"]) for p in view["participants"]) == [(0, "127.0.0.1"), (1, "127.0.0.1")]
        assert sorted(p["pid"] for p in view["participants"]) == sorted([first.pid, second.pid])
        assert "rank 0" in (await status(endpoint, run_id)).stdout.decode()

        # Release the workers: both agents finish the job and close the rendezvous.
        for worker in workers:
            await worker.aclose()
        with anyio.fail_after(DEADLINE):
            assert await first.wait() == 0
            assert await second.wait() == 0
        view = json.loads((await status(endpoint, run_id, "--json")).stdout)
        assert view["closed"] is True


@pytest.mark.anyio
async def test_status_watch_follows_a_live_rendezvous_with_time_left(tmp_path: Path) -> None:
    """``status --watch --json`` started before any node: a line per change; the first agent's join is timed
    from when the watch saw it, and the last call from when the second agent brought the round to min_nodes."""
    run_id = "watch-status"
    conf = "is_host=false,join_timeout=120,last_call_timeout=60"
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(open_store_server("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{server.port}"
        start = await stack.enter_async_context(agents())
        env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")} | {"PROBE_OUT": str(tmp_path)}
        argv = [sys.executable, "-m", "aelastic", "status", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", run_id, "--rdzv-conf", conf, "--nnodes", "2:3", "--watch", "--json"]  # fmt: skip
        watcher = await stack.enter_async_context(await anyio.open_process(argv, stdin=subprocess.DEVNULL))
        stack.callback(watcher.kill)
        assert watcher.stdout is not None
        lines = TextReceiveStream(watcher.stdout)
        buffered = ""

        async def next_view(done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
            nonlocal buffered
            with anyio.fail_after(DEADLINE):
                while True:
                    while "\n" not in buffered:
                        buffered += await lines.receive()
                    line, buffered = buffered.split("\n", 1)
                    view: dict[str, Any] = json.loads(line)
                    if done(view):
                        return view

        view = await next_view(lambda v: True)
        assert (view["exists"], view["clock"]) == (False, "viewer")

        flags = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "--rdzv-id", run_id, "--rdzv-conf", conf, PROBE]  # fmt: skip
        first = await start(*flags, env=env, stderr=subprocess.DEVNULL)
        view = await next_view(lambda v: len(v["participants"]) == 1)
        assert view["reason"] == "waiting for 1 more node (have 1, min 2)"
        (node,) = view["participants"]
        assert node["pid"] == first.pid
        assert 0 < node["join_seconds_left"] <= 120
        assert view["last_call_seconds_left"] is None

        second = await start(*flags, env=env, stderr=subprocess.DEVNULL)
        view = await next_view(lambda v: len(v["participants"]) == 2)
        assert sorted(p["pid"] for p in view["participants"]) == sorted([first.pid, second.pid])
        assert 30 < view["last_call_seconds_left"] <= 60, view
        assert re.fullmatch(r"last call: completes in \d+s unless 1 more node joins first \(have 2, min 2, max 3\)",
                            view["reason"]), view  # fmt: skip
        # While the last call runs, each participant's join lasts at least until its end (the nodes' own rule).
        assert all(p["join_seconds_left"] >= view["last_call_seconds_left"] for p in view["participants"]), view


@pytest.mark.anyio
async def test_status_errors_are_one_line() -> None:
    async with open_store_server("127.0.0.1", 0) as server:
        result = await status(f"127.0.0.1:{server.port}", "nobody-here")
        assert result.returncode == 0
        assert "no node has opened this run id" in result.stdout.decode()
    # The server is gone: connection refused.
    result = await status(f"127.0.0.1:{server.port}", "x")
    assert result.returncode == 1
    assert result.stderr.decode().count("\n") == 1, result.stderr
    assert b"aelastic status: error: " in result.stderr
    assert b"Traceback" not in result.stderr
    argv = [sys.executable, "-m", "aelastic", "status", "--rdzv-backend", "static", "--rdzv-endpoint", "h:1"]
    result = await anyio.run_process(argv, check=False)
    assert result.returncode == 2
    assert b"keeps no shared rendezvous state" in result.stderr


@pytest.mark.anyio
async def test_live_line_on_a_terminal_only(tmp_path: Path) -> None:
    run_id = "live-line"
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(open_store_server("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{server.port}"
        backend = StoreBackend(await stack.enter_async_context(open_store_client("127.0.0.1", server.port)), run_id)
        start = await stack.enter_async_context(agents())
        env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")} | {"PROBE_OUT": str(tmp_path)}
        master, slave = pty.openpty()
        stack.callback(os.close, master)
        try:
            on_tty = await start(*job_flags(endpoint, run_id, "3"), PROBE, env=env, stderr=slave)
        finally:
            os.close(slave)
        on_pipe = await start(*job_flags(endpoint, run_id, "3"), PROBE, env=env, stderr=subprocess.PIPE)
        await wait_for_state(backend, lambda s: len(s.participants) == 2)

        expected = b"aelastic: rendezvous 'live-line' round 0: waiting for 1 more node (have 2, min 3)"
        seen = b""
        with anyio.fail_after(DEADLINE):
            while expected not in seen:
                await anyio.wait_readable(master)
                seen += os.read(master, 4096)
        assert b"\r\x1b[K" in seen  # redrawn in place

        for process in (on_tty, on_pipe):
            process.send_signal(signal.SIGTERM)
        assert on_pipe.stderr is not None
        with anyio.fail_after(DEADLINE):
            piped = b"".join([chunk async for chunk in on_pipe.stderr])
            await on_pipe.wait()
        assert b"waiting for" not in piped
        assert b"\x1b[K" not in piped


@pytest.mark.anyio
async def test_status_of_an_etcd_rendezvous(etcd_endpoint: str) -> None:
    run_id = f"status-etcd-{uuid.uuid4().hex}"  # a new run on the session's etcd
    params = RendezvousParameters("etcd", etcd_endpoint, run_id, 2, 2, key_prefix="/test/status")
    async with (
        open_rendezvous(params) as handler,
        open_rendezvous(params) as second,  # joins only when the test says
        anyio.create_task_group() as tg,
    ):
        assert isinstance(handler, DynamicRendezvousHandler)
        tg.start_soon(handler.next_rendezvous)  # one node of min 2: it waits
        await wait_for_state(handler.backend, lambda s: len(s.participants) == 1)
        argv = [sys.executable, "-m", "aelastic", "status", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_endpoint,
                "--rdzv-id", run_id, "--rdzv-conf", "key_prefix=/test/status", "--nnodes", "2", "--json"]  # fmt: skip
        with anyio.fail_after(DEADLINE):
            result = await anyio.run_process(argv, check=False)
        assert result.returncode == 0, result.stderr
        view = json.loads(result.stdout)
        assert view["reason"] == "waiting for 1 more node (have 1, min 2)"
        assert [p["pid"] for p in view["participants"]] == [os.getpid()]

        # --watch over etcd: woken by its watch; the node listed before the watch began has no timed join.
        watcher = await anyio.open_process([*argv, "--watch"], stdin=subprocess.DEVNULL)
        async with watcher, AsyncExitStack() as stack:
            stack.callback(watcher.kill)
            assert watcher.stdout is not None
            lines = TextReceiveStream(watcher.stdout)
            received = ""
            with anyio.fail_after(DEADLINE):
                while received.count("\n") < 1:
                    received += await lines.receive()
                first = json.loads(received.split("\n")[0])
                assert [p["join_seconds_left"] for p in first["participants"]] == [None]
                tg.start_soon(second.next_rendezvous)  # the second of min 2, max 2: the round completes
                while not any(json.loads(line)["complete"] for line in received.splitlines()):
                    received += await lines.receive()
        tg.cancel_scope.cancel()


def test_ten_thousand_nodes_render_as_a_summary_unless_all_are_asked_for() -> None:
    nodes = tuple(NodeDesc(f"10.1.{i // 8 // 250}.{i // 8 % 250}", 100 + i % 8, 0) for i in range(10_000))
    state = RendezvousState(round=2, participants=nodes[:9_990], wait_list=nodes[9_990:])
    view = describe(state, settings(10_000, 10_000), run_id="big", backend="c10d", endpoint="h:1")
    text = view.render()
    assert len(text.splitlines()) < 60
    assert "participants (ranks fixed at completion) (9990):" in text
    assert f"... and {9_990 - LIST_LIMIT} more on 1247 host(s) (--all lists every node)" in text
    assert "waiting for the next round (10):" in text
    assert "more on" not in text.split("waiting for the next round")[1]  # 10 fit under the limit
    everything = view.render(None)
    assert len(everything.splitlines()) > 10_000
    assert all(n.id in everything for n in nodes)


# --- a third-party backend ------------------------------------------------------------------------------------------


class _FixedReader(StateReader):
    """A third-party backend's reader: one state, which never changes."""

    def __init__(self, state: RendezvousState) -> None:
        self.seen = Versioned(1, encode_state(state))

    async def read_state(self) -> Versioned:
        await anyio.lowlevel.checkpoint()
        return self.seen

    async def wait_for_change(self, seen: Versioned) -> None:
        await anyio.sleep_forever()


@pytest.mark.anyio
async def test_status_shows_a_third_party_backend_through_its_registered_reader(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """status knows no backend by name: a registered backend's entry opens its reader and derives its settings."""
    monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    opened: list[RendezvousParameters] = []

    @asynccontextmanager
    async def open_reader(params: RendezvousParameters) -> AsyncIterator[StateReader]:
        opened.append(params)
        yield _FixedReader(RendezvousState(participants=(A,), endpoints={A: "10.0.0.1:4000"}))

    def settings_of(params: RendezvousParameters) -> RendezvousSettings:
        return RendezvousSettings(params.run_id, params.min_nodes, params.max_nodes, last_call_timeout=7.0)

    @asynccontextmanager
    async def no_handler(
        params: RendezvousParameters, *, observer: JoinObserver | None = None
    ) -> AsyncIterator[RendezvousHandler]:
        raise AssertionError("status must not open a handler")
        yield  # an async generator, as an opener is

    register_backend("third-party", no_handler, open_reader=open_reader, settings=settings_of)
    args = argparse.Namespace(
        rdzv_backend="third-party", rdzv_endpoint="somewhere:1", rdzv_id="job", nnodes="2:3", rdzv_conf="",
        timeout=5.0, json=True, show_all=False, watch=False,
    )  # fmt: skip
    with anyio.fail_after(10):
        assert await command(args)() == 0
    view = json.loads(capsys.readouterr().out)
    assert [n["id"] for n in view["participants"]] == [A.id]
    assert (view["backend"], view["min_nodes"], view["max_nodes"]) == ("third-party", 2, 3)
    assert "last_call_timeout=7s" in view["timing"]  # the entry's settings, not the shared timing keys' 30 s
    assert [p.run_id for p in opened] == ["job"]


def test_status_refuses_a_backend_whose_entry_has_no_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    register_backend("no-state", open_rendezvous)
    with pytest.raises(ConfigurationError, match="'no-state': keeps no shared rendezvous state to show"):
        check_readable(RendezvousParameters("no-state", "somewhere:1", "job", 1, 1))
