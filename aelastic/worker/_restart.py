"""``aelastic.worker.restartable``: the worker's side of in-process restarts (see :mod:`aelastic.agent.restart`).

::

    @aelastic.worker.restartable
    def train():
        dist.init_process_group("gloo")       # from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as always
        state = ...; aelastic.checkpoint.load(into=state)
        for step in ...:
            ...

    train()

Under an aelastic agent, the wrapper registers the worker as restartable and calls the function. When the
function's call ends with an exception, the wrapper tells the agent what it was and waits for the agent's word:

* *restart*: a peer failed, a node was lost or joined; this worker is a survivor. The wrapper destroyed the
  process groups before it asked (aborting them first where the backend can: NCCL): a peer blocked in a collective
  with this worker is released only when its connections close. It takes the new round's environment (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of a fresh store, ``TORCHELASTIC_RESTART_COUNT``,
  ...) into ``os.environ``, and calls the function again, in the same process.
* *fail*: the exception is this worker's own failure; the wrapper re-raises it: the process ends as it would have,
  and the agent replaces it with a fresh one. Such an exception (neither an abort nor a collective's failure) is
  reported before the groups are destroyed, by a thread meanwhile: the agent starts the next round at once, and the
  worker's exit report (:mod:`aelastic.agent.link`) waits for that thread before the teardown yields its CPUs.

When the agent decides on a new round while the function runs (a failure elsewhere, a node joining), it sends an
*abort* (with the seconds it has to let go) on the worker's events socket; a thread of the wrapper then aborts the
process groups (NCCL: the blocked collective returns) and raises :class:`RestartRequested` into the function's
thread, where it surfaces at the next Python bytecode. A main thread blocked in a wait that a signal interrupts
(``time.sleep``, a lock or a queue, ``select``: a step waiting on its data or on a device) is woken for it by
:data:`WAKE_SIGNAL`; a thread blocked in C otherwise, e.g. in a gloo collective, sees it once that call returns (a
gloo collective returns when the failed peer's connections close; the agent kills a peer that hangs). A worker
still held halfway through its grace writes its threads' stacks to stderr (the worker's log) first.
Before the first call the wrapper freezes the garbage collector's view of the objects that exist (``gc.freeze``:
what the imports made), so that the full collections a framework runs as each round starts are quick; garbage in
reference cycles made before the first call is never collected then. It also has ``malloc`` keep large blocks in
the process's heap (:mod:`aelastic.worker._checkpoint.heap`): a next round's state takes the memory the last one
freed, already resident.
The function must allow being called again in the same process: it keeps no object of the old process group, and it
loads its state at the top of each call (``aelastic.checkpoint.load``).

Outside an agent (plain ``python``, torchrun), the function is called once, as written.

Protocol, over the worker's link (:mod:`aelastic.agent.link`): ``restart.register`` is answered with one fd, the
worker's end of an events socket (``SOCK_SEQPACKET``, JSON messages: ``{"event": "abort", "reason": ..., "grace":
seconds, "verdicts": n}``, which ends the call that follows the agent's n-th verdict: one read late, after that call
reported its own end, is ignored; ``"lost": true`` when members left the round). The worker answers on the same
socket ``{"event": "held", "where": ..., "verdicts": n}`` when such an abort finds its call held in a collective (see
:data:`HELD_AFTER`);
``restart.raised`` (``error``, ``distributed``: whether it comes from a collective, ``aborted``: whether the agent
asked for it) is answered once the agent has decided: ``{"verdict": "restart", "env": {...}}`` or ``{"verdict":
"fail"}``.

Standard library only; torch is used only where the worker already imported it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
import traceback
import types
from collections.abc import Callable
from typing import Any, Final, NamedTuple, TypeVar

from ._checkpoint import heap
from ._link import AgentLink, LinkRefused, agent_link, before_yield

__all__ = ["RestartRequested", "is_distributed_error", "restartable"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What a collective's failure says when a peer went away (gloo's transport, NCCL's watchdog, torch's store).
PEER_FAILURE_MARKERS: Final = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL", "gloo",
                         "ProcessGroup", "c10d", "Timed out", "timed out")  # fmt: skip


# After an abort for lost members, a call whose thread has not moved for this long, its innermost Python frame in
# torch.distributed (a collective, a wait on one) or in autograd (a backward whose hooks wait on one), is held in
# a collective with a peer that vanished without closing its connections: gloo's returns only when they close, or
# at its timeout. The worker says so at once, and its agent replaces it instead of waiting out the abort's grace.
HELD_AFTER: Final = 0.25
HELD_IN: Final = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}torch{os.sep}autograd{os.sep}")

# Sent to the main thread with an abort, to end a wait of the function's that a signal interrupts. Ignored by
# default and seldom used (out-of-band socket data): one that arrives after the call ended, or finds no handler,
# does nothing.
WAKE_SIGNAL: Final = signal.SIGURG


class RestartRequested(BaseException):
    """Raised into the function's thread when the agent ends the current round (a ``BaseException``, as
    ``KeyboardInterrupt``: an ``except Exception`` in the training code does not swallow it)."""


def is_distributed_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective's or the store's failure, as a peer's loss makes one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        kind = type(current)
        if any(k.__module__.startswith("torch.distributed") or k.__name__.startswith("Dist") for k in kind.__mro__):
            return True
        if isinstance(current, (RuntimeError, ConnectionError, TimeoutError)) and any(
            marker in str(current) for marker in PEER_FAILURE_MARKERS
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def _abort_groups(dist: Any) -> None:
    """Abort the process groups where the backend can release a blocked collective that way (NCCL). gloo's abort
    releases nothing (its collectives return when the peers' connections close) and may wait for the collective
    under way, so it is not called."""
    try:
        if "nccl" not in str(dist.get_backend()):
            return
        dist.distributed_c10d._abort_process_group()
    except Exception as exc:  # best effort: destroying follows
        logger.debug("aborting the process groups: %r", exc)


def _teardown() -> None:
    """Abort (NCCL) and destroy every process group of torch.distributed, if it is in use."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    c10d = dist.distributed_c10d
    if not dist.is_initialized():
        _adopt_half_made(c10d)
    if dist.is_initialized():
        _abort_groups(dist)
    if dist.is_initialized():  # an abort may have destroyed them already
        try:
            dist.destroy_process_group()
        except Exception as exc:
            logger.warning("aelastic: destroying the process groups failed (%r); going on", exc)
    if not dist.is_initialized():
        c10d._world.group_count = 0


def _adopt_half_made(c10d: Any) -> None:
    """An abort can cut ``init_process_group`` short after it named the default group (torch numbers the names) and
    built it, before it made it the default: the group, half made, becomes the default here so that it is destroyed
    as a whole. Then (as after any teardown) the numbering starts over: a survivor that named the next round's group
    "1" would wait forever for keys its fresh peers write under "0", and they for its."""
    world = c10d._world
    if world.pg_map:
        c10d._update_default_pg(next(iter(world.pg_map)))


class _Session:
    """This worker's registration with its agent: the events socket, its listener thread, and whether the
    function runs now (an abort raises into its thread only then)."""

    def __init__(self, link: AgentLink, events: socket.socket) -> None:
        self.link = link
        self.events = events
        self.lock = threading.Lock()
        self.running: int | None = None  # the thread ident running the function
        self.calls = 0  # the function's calls so far
        self.asked = 0  # the last call whose end was reported to the agent
        self.reports = 0  # the calls' ends reported to the agent, each answered by one verdict
        self.waking = False  # the main thread was sent WAKE_SIGNAL for the running call's abort
        self.listener = threading.Thread(target=self._listen, name="aelastic-restart", daemon=True)
        self.listener.start()

    def _listen(self) -> None:
        while True:
            try:
                data = self.events.recv(1 << 16)
            except OSError:
                return
            if not data:
                return  # the agent is gone
            event = json.loads(data)
            if event.get("event") == "abort":
                self._abort(str(event.get("reason", "")), float(event.get("grace", 10.0)), int(event["verdicts"]),
                            bool(event.get("lost")))  # fmt: skip

    def _abort(self, reason: str, grace: float, verdicts: int, lost: bool) -> None:
        """End the call the agent gave ``verdicts`` verdicts before, if it runs; ``lost``: members left the round."""
        with self.lock:
            ident = self.running
            if ident is None:
                return  # between calls: the agent's word comes as the verdict
            if verdicts != self.reports:
                return  # an earlier call's, which reported its end by itself before this listener read the abort
            _raise_in(ident, RestartRequested)
            if ident == threading.main_thread().ident and signal.getsignal(WAKE_SIGNAL) is _wake:
                self.waking = True
                signal.pthread_kill(ident, WAKE_SIGNAL)
            calls = self.calls
        # Half the grace later, a call that has not let go says where it is held, before the agent kills it.
        timer = threading.Timer(grace / 2, self._report_held, args=(calls, reason, grace))
        timer.daemon = True
        timer.start()
        if lost:
            checked = threading.Timer(HELD_AFTER, self._say_if_held, args=(calls, verdicts, ident, _position(ident)))
            checked.daemon = True
            checked.start()
        # Outside the lock: the function's thread takes it on its way out, which a blocked abort must not hold up.
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            _abort_groups(dist)

    def _say_if_held(self, calls: int, verdicts: int, ident: int, then: tuple[types.FrameType, int] | None) -> None:
        """Tell the agent that call ``calls`` (the one after ``verdicts`` verdicts) is held in a collective, if it has
        not let go and its thread is where it was :data:`HELD_AFTER` ago, in one of :data:`HELD_IN`."""
        with self.lock:
            if self.asked >= calls:
                return  # it let go
        now = _position(ident)
        if now is None or now != then:
            return  # its call ended, or it moved: not held
        frame = now[0]
        if not any(part in frame.f_code.co_filename for part in HELD_IN):
            return
        where = f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
        with contextlib.suppress(OSError):  # the agent is gone: nothing to tell
            self.events.send(json.dumps({"event": "held", "where": where, "verdicts": verdicts}).encode())

    def _report_held(self, calls: int, reason: str, grace: float) -> None:
        with self.lock:
            if self.asked >= calls:
                return  # it let go
            sys.stderr.write(f"aelastic: this worker has not let go of its function {grace / 2:g}s after the agent "
                             f"ended the round ({reason}); it is killed at {grace:g}s. Its threads:\n")  # fmt: skip
            sys.stderr.flush()
            with contextlib.suppress(Exception):  # a stderr without a file descriptor
                faulthandler.dump_traceback(sys.stderr, all_threads=True)

    def enter(self) -> None:
        with self.lock:
            self.running = threading.get_ident()
            self.calls += 1

    def leave(self) -> None:
        with self.lock:
            if self.running is not None:
                _raise_in(self.running, None)  # withdraw one that was not raised yet
            self.running, self.waking = None, False

    def ask(self, exc: BaseException, sent: Callable[[], None] | None = None) -> dict[str, str] | None:
        """The agent's word on ``exc``: the new round's environment, or ``None`` (fail); ``sent`` is called once the
        report is on its way."""
        error = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"[:4000]
        aborted = isinstance(exc, RestartRequested)
        with self.lock:
            self.asked = self.calls
            self.reports += 1
        try:
            reply, _ = self.link.request("restart.raised", sent=sent, error=error,
                                         distributed=is_distributed_error(exc), aborted=aborted)  # fmt: skip
        except (OSError, LinkRefused) as failure:
            logger.warning("aelastic: no word from the agent on %s (%s): failing", error, failure)
            return None
        if reply.get("verdict") != "restart":
            return None
        env: dict[str, str] = reply["env"]
        return env


def _position(ident: int) -> tuple[types.FrameType, int] | None:
    """Where thread ``ident`` is: its innermost Python frame and the instruction in it."""
    frame = sys._current_frames().get(ident)
    return None if frame is None else (frame, frame.f_lasti)


def _raise_in(ident: int, kind: type[BaseException] | None) -> None:
    """Have thread ``ident`` raise ``kind`` at its next bytecode (``None``: withdraw a pending one)."""
    import ctypes  # only a restartable worker pays for it

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None if kind is None else ctypes.py_object(kind))


def _wake(signum: int, frame: object) -> None:
    """:data:`WAKE_SIGNAL`'s handler: ends the main thread's interrupted wait with the abort's exception. (Where the
    interpreter checks for pending exceptions on entering a function, the one already raised into the thread surfaces
    here first.) The lock is not taken: the handler may run while the main thread holds it."""
    session = _session
    if session is not None and session.waking:
        session.waking = False
        _raise_in(threading.get_ident(), None)
        raise RestartRequested


_session: _Session | None = None
_session_lock = threading.Lock()


def _register(link: AgentLink) -> _Session | None:
    global _session
    with _session_lock:
        if _session is None:
            try:
                _, fds = link.request("restart.register")
            except (OSError, LinkRefused) as exc:
                logger.warning("aelastic: this worker could not register for in-process restarts (%s): it runs its "
                               "function once", exc)  # fmt: skip
                return None
            _session = _Session(link, socket.socket(fileno=fds[0]))
            if threading.current_thread() is threading.main_thread() and signal.getsignal(WAKE_SIGNAL) in (
                signal.SIG_DFL, signal.SIG_IGN):  # fmt: skip
                signal.signal(WAKE_SIGNAL, _wake)  # a handler of the program's own is left alone
        return _session


class _Returned(NamedTuple):
    value: Any


def _call(session: _Session, fn: Callable[..., Any], args: Any, kwargs: Any) -> _Returned | dict[str, str]:
    """One call of ``fn``: what it returned, or the environment of the round to call it again in."""
    # torch's init_process_group wraps sys.excepthook (to prefix its lines with "[rank<N>]:") on every call and
    # never unwraps it: each round's call would add a prefix, with the rank of its round.
    hook = sys.excepthook
    try:
        try:
            session.enter()
            return _Returned(fn(*args, **kwargs))
        finally:
            session.leave()
    except (KeyboardInterrupt, SystemExit):
        raise  # the agent stops the worker (SIGINT), or the function exits on purpose: not a restart
    except BaseException as exc:
        if isinstance(exc, RestartRequested) or is_distributed_error(exc):
            # A survivor, or a victim of a failure elsewhere, lets go of its groups before it reports: the agent
            # takes the report as the sign that it let go (one whose teardown hangs is killed after the grace).
            _release(exc)
            env = session.ask(exc)
            if env is None:
                raise
        else:
            # Its own failure, whose verdict is nearly always to fail: the agent hears of it at once and starts the
            # next round while a thread releases the groups. If the verdict is to fail, the exit report (where the
            # worker makes one) waits for that thread before the teardown yields the CPUs, since peers blocked with
            # this worker wait for it; the interpreter's exit waits for it in any case (not a daemon).
            releasing = threading.Thread(target=_release, args=(exc,), name="aelastic-release")
            env = session.ask(exc, sent=releasing.start)
            if releasing.ident is None:  # the report could not be sent
                releasing.start()
            if env is None:
                before_yield(releasing.join)
                raise
            releasing.join()
        sys.excepthook = hook
        return env


def _release(exc: BaseException) -> None:
    """Close this worker's process groups: a peer blocked in a collective with it is released only when its
    connections close, and the next round waits for that peer. gloo closes them when the group's last reference
    goes, and the finished frames of the tracebacks hold some (the collective's ``group`` and ``work``, the training
    code's objects): their locals are cleared (the tracebacks still print as they would). Every exception of the
    chain counts: an abort's exception, raised as a collective's failure unwinds, has that failure as its context,
    and only the failure's traceback holds the collective's frame."""
    for error in _chained(exc):
        traceback.clear_frames(error.__traceback__)
    _teardown()


def _chained(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it leads to: its cause and its context, and theirs."""
    found: dict[int, BaseException] = {}
    pending = [exc]
    while pending:
        error = pending.pop()
        if id(error) not in found:
            found[id(error)] = error
            pending.extend(e for e in (error.__cause__, error.__context__) if e is not None)
    return list(found.values())


def restartable(fn: Callable[..., T]) -> Callable[..., T]:
    """Run ``fn`` so that a new round of the job calls it again in this process; see the module doc."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        link = agent_link()
        session = None if link is None else _register(link)
        if session is None:
            return fn(*args, **kwargs)
        # What exists before the first call (the modules that imports made: hundreds of thousands of objects with
        # torch and a framework) lasts as long as the process: out of the collector's way, the full collections that
        # frameworks run as a round starts (Accelerate's free_memory) look at the rounds' objects only.
        gc.freeze()
        heap.keep()  # a next round allocates its state again: from the memory the last one freed, still resident
        while True:
            outcome = _call(session, fn, args, kwargs)
            if isinstance(outcome, _Returned):
                value: T = outcome.value
                return value
            os.environ.update(outcome)

    return wrapper
