"""The worker's end of its link to the agent (the child side of :mod:`aelastic.agent.link`).

The agent starts every worker holding one end of a ``SOCK_SEQPACKET`` socket pair, named by :data:`LINK_ENV`
(``<fd>:<agent pid>``). The first call of :func:`agent_link` in the worker takes it over: the variable leaves the
environment and the fd is no longer inherited, so the worker's own children (DataLoader workers, subprocesses) never
see it; a process whose parent is not the agent (a child forked before that first call) gets ``None``.

Protocol: each request is one message, a JSON object with an ``op`` and an ``id`` (and file descriptors as
``SCM_RIGHTS`` where an operation passes some), answered by exactly one message: a JSON object with the same ``id``,
and ``"error"`` holding a one-line reason when the agent refused it. Requests from several threads of the worker are
serialized. A request cut short after it was sent (an exception raised into the thread: an in-process restart's)
leaves its answer behind, which the next request recognises by its id and drops.

**Exit reports.** :func:`install_exit_report` chains ``sys.excepthook`` so that a worker ending with an uncaught
exception tells the agent its exit status (1) right after the traceback is printed, before the interpreter's
teardown (which, with torch and its process groups loaded, takes about half a second): the agent starts the next
attempt then, and reaps the old process when its teardown is over. Once the agent has the report, the teardown goes
on under ``SCHED_IDLE`` (every thread): it still runs whole (``atexit`` handlers, buffered output), but a worker that
wakes on its CPU takes it at once, and the kernel places a waking task on a CPU that runs only idle tasks as on an
idle one (at nice 19 a restore beside it waited for it). Against other sessions only its session's share counts:
the agent lowers that for the next attempt's start and gives it back a second later
(:data:`aelastic.agent.shares.QUIET_TEARDOWN`), since survivors blocked in a collective with it are released only when
its sockets close (on a busy node, a teardown left at the lowest share could hold a survivor past its grace).

Standard library only: this runs in the worker's interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = [
    "LINK_ENV",
    "MAX_FDS",
    "MAX_MESSAGE",
    "AgentLink",
    "LinkRefused",
    "agent_link",
    "before_yield",
    "install_exit_report",
    "report_exit",
]

LINK_ENV: Final = "AELASTIC_AGENT_LINK"
MAX_MESSAGE: Final = 1 << 20
MAX_FDS: Final = 8
# An exit report waits this long for the agent's acknowledgement: the report only speeds up the agent, which
# otherwise learns of the exit from the kernel, so a stuck agent must not hold up the worker's own end.
_EXIT_REPORT_TIMEOUT: Final = 5.0


class LinkRefused(Exception):
    """The agent answered a request with an error (its one-line reason is the message)."""


class AgentLink:
    """One end of the link, used from any thread of the worker (requests are serialized)."""

    def __init__(self, fd: int) -> None:
        self._socket = socket.socket(fileno=fd)
        self._lock = threading.Lock()
        self._next_id = 0

    def __repr__(self) -> str:
        return f"<AgentLink fd={self._socket.fileno()}>"

    def request(
        self,
        op: str,
        fds: Sequence[int] = (),
        *,
        timeout: float | None = None,
        sent: Callable[[], None] | None = None,
        **fields: Any,
    ) -> tuple[dict[str, Any], list[int]]:
        """Send one request and return the agent's answer and the fds it passed; ``sent`` is called once the request
        is on its way, before the answer is awaited.

        Raises:
            LinkRefused: the agent refused the request.
            ConnectionError: the agent is gone (its end closed).
            TimeoutError: no answer within ``timeout`` seconds (``None``: wait as long as it takes).
        """
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            self._socket.settimeout(timeout)
            socket.send_fds(self._socket, [json.dumps({"op": op, "id": ident, **fields}).encode()], list(fds))
            if sent is not None:
                sent()
            while True:
                data, received, _, _ = socket.recv_fds(self._socket, MAX_MESSAGE, MAX_FDS)
                if not data:
                    _close(received)
                    raise ConnectionError("the agent closed the link")
                reply: dict[str, Any] = json.loads(data)
                if reply.get("id") == ident:
                    break
                _close(received)  # the answer to a request cut short: nobody waits for it any more
        if "error" in reply:
            _close(received)
            raise LinkRefused(reply["error"])
        return reply, received


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


_link: AgentLink | None = None
_link_lock = threading.Lock()


def agent_link() -> AgentLink | None:
    """This worker's link to its agent, taken over on the first call; ``None`` where there is none (not started by
    an aelastic agent, or a child of the worker)."""
    global _link
    with _link_lock:
        if _link is None:
            value = os.environ.get(LINK_ENV, "")
            fd, _, parent = value.partition(":")
            if not (fd.isdigit() and parent.isdigit()) or os.getppid() != int(parent):
                return None
            del os.environ[LINK_ENV]
            os.set_inheritable(int(fd), False)
            _link = AgentLink(int(fd))
        return _link


def report_exit(code: int) -> bool:
    """Tell the agent that this worker is ending with ``code``; whether the agent acknowledged it."""
    link = agent_link()
    if link is None:
        return False
    for stream in (sys.stdout, sys.stderr):  # what the worker wrote reaches its pipes before the agent hears
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    try:
        link.request("exit", code=code, timeout=_EXIT_REPORT_TIMEOUT)
    except (OSError, LinkRefused):  # the agent learns of the exit from the kernel instead
        return False
    finally:
        while _before_yield:
            _before_yield.pop()()
    _yield_cpus()
    return True


_before_yield: list[Callable[[], None]] = []


def before_yield(work: Callable[[], None]) -> None:
    """Have :func:`report_exit` run ``work`` once the agent has the report, before the teardown yields the CPUs: work
    that others wait for (a peer blocked in a collective waits for this worker's connections to close)."""
    _before_yield.append(work)


def _yield_cpus() -> None:
    """``SCHED_IDLE`` for every thread of this process (a policy is per thread on Linux; lowering it needs no
    privilege, and the process never leaves it)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))


def _excepthook(previous: Any, kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
    previous(kind, value, tb)
    if threading.current_thread() is threading.main_thread() and not issubclass(kind, KeyboardInterrupt):
        report_exit(1)  # an uncaught exception ends the interpreter with 1 (KeyboardInterrupt: by SIGINT)


def install_exit_report() -> None:
    """Report an uncaught exception's exit status to the agent before teardown (see the module doc); does nothing
    where the worker has no link, or when installed already."""
    if agent_link() is None or getattr(sys.excepthook, "__aelastic_exit_report__", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        _excepthook(previous, kind, value, tb)

    hook.__aelastic_exit_report__ = True  # type: ignore[attr-defined]
    sys.excepthook = hook
