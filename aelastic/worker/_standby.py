"""A standby worker interpreter, the child side of :mod:`aelastic.agent.prewarm`::

    python [-u] -m aelastic.worker._standby <fd> <sys.path[0]> <preload> idle|normal

The agent starts it (:mod:`~aelastic.agent.prewarm.parent`) exactly as it starts a worker, with the workers'
environment minus the per-attempt variables, and with the interpreter options the worker's command line has
(``-u``), so everything the interpreter decides at start-up (``sys.flags``, the hash seed, the locale, ``sys.path`` from
``PYTHONPATH``) is what the worker's own start would decide. It sets ``sys.path[0]`` to the worker's (the script's
directory, or the working directory for ``-m``), imports the preload list (``torch`` and ``torch._dynamo``, which
every optimizer imports, when importable; then the user's ``--prewarm-modules``), and blocks reading its control
socket.

The assignment is one ``SOCK_SEQPACKET`` message, read once the preload is done and answered with
:data:`PRELOADED` (the agent starts the next standbys only then, never beside this one's preload): a versioned
JSON object (the environment, the working directory, the target and its arguments) and, as ``SCM_RIGHTS``, the
attempt's stdout and stderr (fresh pipes or pseudo-terminals made by the agent for this attempt, as for a cold
start) and the fds the worker is to inherit.
The standby copies what the preload wrote (to memfds the agent gave it as stdout and stderr) to the new streams,
so import-time warnings reach the worker's log as they would have; moves the new streams onto fds 1 and 2; takes
the environment, the working directory and ``sys.argv``; and runs the target in a fresh ``__main__`` module as
``python script.py`` / ``python -m module`` would, the same exit codes and uncaught-exception report included.
End of file on the control socket (the agent is going away) exits 0 without running anything.

Before the assignment, the agent may send warmings (``{"version": ..., "warm": bytes}``, no reply): the size of the
largest training state in host memory this node's workers saved. The standby then touches that much of its heap for
the state its worker will allocate (:mod:`aelastic.worker._checkpoint.heap`), at its own priority, and stops at
once when the next message arrives. Likewise the slots of the rank its local rank held (``{"version": ..., "map":
[[slot, generation, capacity], ...], "rank": ...}``, their memory files as ``SCM_RIGHTS``): it maps them for the
worker's restore (:mod:`aelastic.worker._checkpoint.premapped`).

Priority: the preload is the only CPU a standby spends (then it sleeps in ``recvmsg``). Started beside running
workers (``idle``), it runs under ``SCHED_IDLE`` so that it never takes a CPU from them, but only where the process
may leave ``SCHED_IDLE`` again before it runs the worker (``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` that allows nice
0): an unprivileged process cannot undo ``SCHED_IDLE`` or a raised nice value, and the worker (and its DataLoader
children, which inherit it) would train at idle priority. Elsewhere it preloads at the workers' own priority, as
do the first attempt's standbys (``normal``: no worker runs yet, and on a busy host an idle-class preload would
make no progress while the rendezvous waits). When the agent hands over an attempt it returns the standby to
``SCHED_OTHER`` itself (:func:`set_policy`), so a preload still running then finishes at the workers' priority.

A worker that fails (an uncaught exception, ``sys.exit`` with a non-zero status) reports its status to the agent
over its link (:mod:`aelastic.agent.link`) as soon as the traceback is printed, before the interpreter's teardown.

This module imports only the standard library and the link's child side (standard library too): the standby's
modules must be the worker's.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, Final

from ._link import report_exit

VERSION: Final = 4
MAX_MESSAGE: Final = 1 << 20  # the assignment: mostly the environment
MAX_FDS: Final = 16  # stdout, stderr, and the fds the worker inherits
PRELOADED: Final = b"preloaded"  # the reply to the assignment
_CHECKPOINT_API: Final = "aelastic.worker._checkpoint.api"
CAP_SYS_ADMIN: Final = 21
_CAP_SYS_NICE: Final = 23


def capable(capability: int) -> bool:
    """Whether this process has ``capability`` (its number) in its effective set."""
    with open("/proc/self/status") as status:
        effective = next((line.split()[1] for line in status if line.startswith("CapEff:")), "0")
    return bool(int(effective, 16) >> capability & 1)


def _may_leave_idle() -> bool:
    """Whether this process may return from SCHED_IDLE to SCHED_OTHER at nice 0 (the kernel's ``can_nice``)."""
    import resource

    return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 or capable(_CAP_SYS_NICE)


def set_policy(pid: int, policy: int) -> None:
    """Every thread of ``pid`` to scheduling ``policy`` (threads the preload started inherited SCHED_IDLE).

    Raises:
        PermissionError: not allowed (see the module doc).
    """
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread exited meanwhile
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))


def _preload(modules: Sequence[str]) -> None:
    torch = importlib.util.find_spec("torch") is not None
    for name in modules:
        if name.partition(".")[0] == "torch" and not torch:
            continue  # the default preload: only where the workers can import it
        try:
            importlib.import_module(name)
        except Exception:  # the worker's own import raises it again, where the user expects it
            continue


def _receive(control_fd: int) -> tuple[dict[str, Any], list[int]] | None:
    """The assignment, once the preload is done; the reply :data:`PRELOADED` tells the agent so. Warmings and slots
    to map may come before it, any number of times: each is worked on until the next message arrives, and resumed
    once that is read, unless it was the assignment."""
    with socket.socket(fileno=control_fd) as control:
        poller = select.poll()
        poller.register(control, select.POLLIN)

        def arrived() -> bool:
            return bool(poller.poll(0))

        unfinished: dict[str, Callable[[], bool]] = {}  # by kind: done (True), or cut short by a message
        while True:
            for kind, work in list(unfinished.items()):
                if not arrived() and work():
                    del unfinished[kind]
            data, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, MAX_FDS)
            if not data:
                return None
            message = json.loads(data)
            if message.get("version") != VERSION:
                raise SystemExit(f"aelastic standby: message version {message.get('version')!r}, expected {VERSION}")
            if "warm" in message:
                unfinished["warm"] = functools.partial(_warm, int(message["warm"]), arrived)
            elif "map" in message:
                _map_slots(message, fds)
                unfinished["map"] = functools.partial(_fill_slots, arrived)
            else:
                break
        with contextlib.suppress(OSError):  # the agent stopped listening: it only wanted to know
            control.send(PRELOADED)
    return message, fds


def _warm(size: int, arrived: Callable[[], bool]) -> bool:
    """Touch ``size`` bytes of heap for the worker's state (:mod:`aelastic.worker._checkpoint.heap`) until a
    message arrives; whether that is done (less with no message waiting: there is nothing more to touch). First,
    the checkpoint API is preloaded: a worker of this job saved, so the worker will import it, and a replacement
    would pay that import on its restore."""
    from ._checkpoint.heap import warm

    _preload((_CHECKPOINT_API,))
    return warm(size, arrived) == size or not arrived()


def _map_slots(message: dict[str, Any], fds: list[int]) -> None:
    """Map the slots of a rank's checkpoints (:mod:`aelastic.worker._checkpoint.premapped`)."""
    from ._checkpoint.premapped import map_slots

    try:
        map_slots(int(message["rank"]), [(int(s), int(g), int(c)) for s, g, c in message["map"]], fds)
    finally:
        for fd in fds:
            os.close(fd)


def _fill_slots(arrived: Callable[[], bool]) -> bool:
    """Fill the mapped slots' page tables until a message arrives; whether that is done."""
    from ._checkpoint.premapped import fill

    return fill(arrived)


def _take_stream(target: int, new: int) -> None:
    """Make ``new`` this process's fd ``target``, after copying to it what the preload wrote to the old one."""
    offset, size = 0, os.fstat(target).st_size
    while offset < size:
        chunk = os.pread(target, min(size - offset, 1 << 16), offset)
        if not chunk:
            break
        offset += len(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(new, view) :]
    os.dup2(new, target)
    os.close(new)


def _own_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without this module's frames at its top: what the interpreter would have printed."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _run_script(path: str) -> None:
    """``python path``: a fresh ``__main__`` with the interpreter's attributes (``__spec__`` is ``None``)."""
    filename = os.path.abspath(path)  # the interpreter makes ``__file__`` and the code's file name absolute
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=filename,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", filename),
        __builtins__=__builtins__,
    )
    sys.modules["__main__"] = main
    with open(filename, "rb") as source:
        code = compile(source.read(), filename, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _run_module(name: str) -> None:
    """``python -m name``: the interpreter's own path (runpy), in a fresh ``__main__`` rather than this module's."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    runpy._run_module_as_main(name, alter_argv=True)  # type: ignore[attr-defined]


def _run(assignment: dict[str, Any], fds: list[int]) -> int:
    out, err, *inherited = fds
    sys.stdout.flush()
    sys.stderr.flush()
    _take_stream(1, out)
    _take_stream(2, err)
    if isinstance(sys.stdout, io.TextIOWrapper) and not sys.stdout.write_through:
        sys.stdout.reconfigure(line_buffering=os.isatty(1))  # no -u: line-buffered when stdout is a terminal
    env: dict[str, str] = assignment["env"]
    for name, template, count in assignment["fd_vars"]:  # their numbers here, not in the agent
        env[name] = template.format(*inherited[:count])
        inherited = inherited[count:]
    os.chdir(assignment["cwd"])
    os.environ.clear()
    os.environ.update(env)
    sys.orig_argv[:] = assignment["orig_argv"]
    is_module = assignment["module"] is not None
    target: str = assignment["module"] if is_module else assignment["script"]
    sys.argv[:] = ["-m" if is_module else target, *assignment["args"]]
    try:
        (_run_module if is_module else _run_script)(target)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) or exc.code is None else 1  # a message exits 1
        if code:  # the agent hears of the failure now, not after the teardown
            _report(code, exc)
        raise
    except BaseException as exc:  # an uncaught exception: reported and ended as the interpreter does
        tb = _own_frames(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, KeyboardInterrupt):  # the interpreter ends by SIGINT then (after atexit)
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        report_exit(1)
        return 1
    return 0


def _report(code: int, exc: SystemExit) -> None:
    """Report a ``SystemExit`` failure before the interpreter prints its message and tears down."""
    if not isinstance(exc.code, (int, type(None))):
        sys.stderr.write(f"{exc.code}\n")  # the interpreter's own message for sys.exit("...")
        exc.code = 1
    report_exit(code)


def main(argv: Sequence[str]) -> int:
    control_fd, path0, preload = int(argv[0]), argv[1], [m for m in argv[2].split(",") if m]
    priority = argv[3]  # "idle": started beside running workers, so it must not compete with them
    os.set_inheritable(control_fd, False)
    sys.path[0] = path0  # ``-m`` put the agent's working directory there; the worker's is the script's own
    idle = priority == "idle" and _may_leave_idle()
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    _preload(preload)
    received = _receive(control_fd)
    if received is None:
        return 0
    if idle:
        try:
            set_policy(os.getpid(), os.SCHED_OTHER)  # the agent did it too, if the preload was still running
        except PermissionError:  # a user namespace's CAP_SYS_NICE is not the kernel's: say so, run anyway
            print("aelastic standby: could not leave SCHED_IDLE; this worker runs at idle priority", file=sys.stderr)  # noqa: T201
    return _run(*received)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
