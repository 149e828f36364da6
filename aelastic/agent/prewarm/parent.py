"""The agent's side of pre-warmed standby interpreters (``--prewarm``); see :mod:`aelastic.agent.prewarm`.

Theory of operation
-------------------
:func:`open_standbys` gives the agent a :class:`Standbys` pool holding at most one idle interpreter per local rank
(:mod:`aelastic.worker._standby`); a worker takes its own local rank's, else any idle one fit for it (a worker
replaced alone does not wait for its rank's refill). Beside an attempt's running workers, :meth:`Standbys.refill` starts
the next attempt's standbys the way workers start (:func:`~aelastic.agent.spawn.parent.spawn_process`: a session of
their own, the parent-death signal, registered with the reaper), so a standby never outlives the agent and, once it
becomes a worker, is supervised like any other: nothing of the no-orphan guarantees changes. The first attempt's
standbys start before its rendezvous. Each preloads, then sleeps; one that dies idle is replaced once. Starting an
attempt, :meth:`Standbys.start` hands each standby the attempt (environment, arguments, the attempt's fresh stdout and
stderr over ``SCM_RIGHTS``) instead of spawning a process; the standby runs the script as ``python script.py`` would,
from its first line.

Only Python entry points have a standby: ``python [-u] script args`` and ``python [-u] -m module args`` (callables
are ``-m aelastic.worker._callables``). Anything else (``--no-python``, other interpreter options, a directory or
zip as the script) starts cold, silently.

What must not differ: a standby starts before its attempt exists, so the variables that change between attempts
(:data:`PER_ATTEMPT`: ranks, sizes, master port, restart counts, the error file) are left out of its environment and
arrive with the assignment; nothing at interpreter start-up or in ``import torch`` reads them (torch reads them in
``init_process_group`` and ``@record``). Every other variable is part of the standby's identity, because the
interpreter or the preload reads it once, at start: ``PYTHONPATH``/``PYTHONHOME``/``PYTHONSAFEPATH`` make
``sys.path``, ``PYTHONHASHSEED`` the hash secret, ``PYTHON*`` flags ``sys.flags``, ``LANG``/``LC_*`` the stdio
encoding, ``LD_PRELOAD``/``LD_LIBRARY_PATH`` the loaded libraries, ``OMP_NUM_THREADS``/``MKL_*``/``KMP_*`` the
OpenMP runtime that ``import torch`` loads and sizes, ``CUDA_VISIBLE_DEVICES`` what the CUDA libraries see. Setting
them in ``os.environ`` afterwards would change nothing in a process that already read them, so a standby whose
environment differs in any of them from the attempt's is discarded and that worker starts cold.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, NamedTuple

import anyio
import anyio.abc

from ...config.options import PrewarmOptions
from ...errors import ReaperError
from ...worker import _standby as standby_child
from ...worker._finish import FINISH_FDS_ENV
from ...worker._link import LINK_ENV
from ..reaper.parent import Reaper
from ..shares import set_session_nice, shares_at_once
from ..spawn.parent import ATTEMPT_VARIABLES, FdVar, WorkerCommand, spawn_process, wait_process

__all__ = ["PER_ATTEMPT", "PythonTarget", "Standbys", "StandbysStatistics", "open_standbys", "python_target"]

logger = logging.getLogger(__name__)

# The variables the agent sets per attempt, and those that name fds a worker inherits (the finish line, its link).
PER_ATTEMPT: Final = ATTEMPT_VARIABLES | {FINISH_FDS_ENV, LINK_ENV}

# Imported only where the workers' interpreter finds torch. torch._dynamo too: every optimizer's first construction
# imports it, which a restarted worker would otherwise pay before its first step.
DEFAULT_PRELOAD: Final = ("torch", "torch._dynamo")


class PythonTarget(NamedTuple):
    """A worker command line that a standby can run: ``python [options] (script | -m module) args``."""

    python: str
    options: tuple[str, ...]
    script: str | None
    module: str | None
    args: tuple[str, ...]

    @property
    def path0(self) -> str:
        """The worker's ``sys.path[0]``: the script's real directory, or the working directory for ``-m``."""
        if self.script is None:
            return os.getcwd()
        return os.path.dirname(os.path.realpath(self.script))


def python_target(args: Sequence[str]) -> PythonTarget | None:
    """``args`` as a :class:`PythonTarget`, or ``None`` when a standby cannot run it exactly (it starts cold)."""
    python, *rest = args
    if not os.path.basename(python).startswith("python"):
        return None
    options = []
    while rest and rest[0] == "-u":  # the one option the standby starts with; any other: cold
        options.append(rest.pop(0))
    if len(rest) >= 2 and rest[0] == "-m":
        return PythonTarget(python, tuple(options), None, rest[1], tuple(rest[2:]))
    if not rest or rest[0].startswith("-") or not os.path.isfile(rest[0]) or _is_zip(rest[0]):
        return None  # python runs a directory or zip by its __main__.py: left to python
    return PythonTarget(python, tuple(options), rest[0], None, tuple(rest[1:]))


def _is_zip(path: str) -> bool:
    import zipfile

    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def _identity(target: PythonTarget, env: Mapping[str, str]) -> tuple[object, ...]:
    """What a standby must share with the worker it becomes (see the module doc)."""
    stable = tuple(sorted((k, v) for k, v in env.items() if k not in PER_ATTEMPT))
    return (target.python, target.options, target.path0, stable)


@dataclass(frozen=True, slots=True)
class StandbysStatistics:
    """What :meth:`Standbys.statistics` reports.

    Attributes:
        idle: the idle standbys' pids, by local rank.
        handed_off: the attempts' workers that started in a standby.
        cold: those that started cold while prewarm was on.
    """

    idle: Mapping[int, int]
    handed_off: int
    cold: int


class _SlotFiles(NamedTuple):
    """A rank's checkpoint slots, as the pool keeps them for its standbys: ``(slot, generation, capacity, memory
    file)`` each."""

    rank: int
    slots: list[tuple[int, int, int, int]]

    def close(self) -> None:
        for slot in self.slots:
            os.close(slot[3])


class _Standby:
    """One idle interpreter: its process, its end of the control socket, what it was started for, and the scope of
    its watch (cancelled when it is handed an attempt or retired)."""

    __slots__ = ("control", "env", "identity", "popen", "quiet", "replacement", "target", "warmed", "watch")

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        control: socket.socket,
        target: PythonTarget,
        env: Mapping[str, str],
        replacement: bool,
    ) -> None:
        self.popen = popen
        self.control = control
        self.target = target
        self.env = env
        self.identity = _identity(target, env)
        self.replacement = replacement  # it replaces one that died idle: if it dies too, its rank starts cold
        self.watch = anyio.CancelScope()
        self.warmed = 0  # the heap it was told to warm (bytes)
        self.quiet = False  # its session has the lowest CPU share (Standbys.refill's quiet)

    def __repr__(self) -> str:
        return f"<standby pid={self.popen.pid} returncode={self.popen.returncode}>"

    def warm(self, size: int) -> None:
        """Tell it to warm ``size`` bytes of heap (:mod:`aelastic.worker._checkpoint.heap`), if it was told
        less; a full socket (it has not read the last one yet) or a dead standby skips it."""
        if size > self.warmed:
            message = json.dumps({"version": standby_child.VERSION, "warm": size}).encode()
            with suppress(OSError):
                self.control.send(message)
                self.warmed = size

    def map_slots(self, slots: _SlotFiles) -> None:
        """Tell it to map a rank's checkpoint slots (:mod:`aelastic.worker._checkpoint.premapped`); skipped
        as :meth:`warm` is."""
        message = {"version": standby_child.VERSION, "rank": slots.rank, "map": [s[:3] for s in slots.slots]}
        with suppress(OSError):
            socket.send_fds(self.control, [json.dumps(message).encode()], [s[3] for s in slots.slots])


class Standbys:
    """The agent's standby interpreters, one per local rank at most (see the module doc)."""

    def __init__(self, preload: Sequence[str], reaper: Reaper | None, watchers: anyio.abc.TaskGroup) -> None:
        self._preload = tuple(dict.fromkeys(preload))
        self._reaper = reaper
        self._watchers = watchers
        self._idle: dict[int, _Standby] = {}
        self._handed: list[socket.socket] = []  # control sockets of standbys handed an attempt, until they reply
        self._warm = 0  # the heap each standby warms for its worker's state (:meth:`warm`)
        self._slots: dict[int, _SlotFiles] = {}  # by local rank: the slots its standby maps (:meth:`map_slots`)
        self.handed_off = 0  # attempts' workers that started from a standby
        self.cold = 0  # those that started cold while prewarm was on

    def __repr__(self) -> str:
        idle = {rank: s.popen.pid for rank, s in sorted(self._idle.items())}
        return f"<Standbys idle={idle} handed_off={self.handed_off} cold={self.cold}>"

    def statistics(self) -> StandbysStatistics:
        """The idle standbys' pids by local rank, and how the attempts' workers started."""
        idle = MappingProxyType({rank: s.popen.pid for rank, s in sorted(self._idle.items())})
        return StandbysStatistics(idle=idle, handed_off=self.handed_off, cold=self.cold)

    async def start(
        self,
        command: WorkerCommand,
        env: Mapping[str, str],
        streams: tuple[int, int],
        fd_vars: Sequence[FdVar] = (),
    ) -> subprocess.Popen[bytes] | None:
        """Hand ``command`` to a standby (its local rank's, else another fit one); ``None`` when there is none fit
        for it (start it cold).

        Args:
            command: the worker (its ``args`` and local rank; ``env`` is the one to run with).
            env: the worker's full environment.
            streams: the worker's ends of its stdout and stderr, as a cold start would get them.
            fd_vars: fds the worker inherits (the finish line's, its link), each named by a variable that the
                standby sets with their numbers there.
        """
        target = python_target(command.args)
        standby = None if target is None else self._take(command.local_rank, _identity(target, env))
        if standby is None or target is None:
            await self._cold(command.local_rank)
            return None
        assignment = {
            "version": standby_child.VERSION,
            "env": dict(env),
            "cwd": os.getcwd(),
            "script": target.script,
            "module": target.module,
            "args": list(target.args),
            "orig_argv": list(command.args),
            "fd_vars": [[var.name, var.template, len(var.fds)] for var in fd_vars],
        }
        inherited = [fd for var in fd_vars for fd in var.fds]
        try:
            await _send(standby.control, json.dumps(assignment).encode(), [*streams, *inherited])
        except OSError as exc:  # it died meanwhile (EPIPE), or the environment is too large (EMSGSIZE)
            logger.warning("standby of local_rank %d (pid %d): %s: starting the worker cold",
                           command.local_rank, standby.popen.pid, exc)  # fmt: skip
            self.cold += 1
            await self._retire(standby)
            return None
        except BaseException:  # cancelled while the socket was full: it is out of the pool, so kill it here
            await self._retire(standby)
            raise
        self._handed.append(standby.control)  # its reply says when its preload is done
        with suppress(OSError):  # a preload still running goes on at the worker's priority (see the child side)
            standby_child.set_policy(standby.popen.pid, os.SCHED_OTHER)
        if standby.quiet:
            set_session_nice(0, standby.popen.pid)
        self.handed_off += 1
        logger.debug("local_rank %d started in its standby (pid %d)", command.local_rank, standby.popen.pid)
        return standby.popen

    async def _cold(self, local_rank: int) -> None:
        """No standby fits ``local_rank``'s worker, which starts cold: its own standby, if any, is retired."""
        self.cold += 1
        own = self._idle.pop(local_rank, None)
        if own is None:
            return
        if own.popen.poll() is not None:
            logger.warning("standby of local_rank %d (pid %d) exited with %d: starting the worker cold",
                           local_rank, own.popen.pid, own.popen.returncode)  # fmt: skip
        else:
            logger.info("standby of local_rank %d: environment or command changed, starting cold", local_rank)
        await self._retire(own)

    def warm(self, size: int) -> None:
        """The largest training state in host memory a worker of this node saved is ``size`` bytes (its CPU
        tensors: a GPU state's replacement allocates on the device): each standby, idle or started from now on,
        touches that much of its heap ahead (:mod:`aelastic.worker._checkpoint.heap`), so that the worker it
        becomes allocates its state without faulting in fresh memory. It holds that memory while it waits."""
        if size > self._warm:
            self._warm = size
            logger.debug("standbys: warming %d bytes of heap each for the workers' state", size)
            for standby in self._idle.values():
                standby.warm(size)

    def map_slots(self, local_rank: int, rank: int, slots: Sequence[tuple[int, int, int, int]]) -> None:
        """The checkpoint slots of ``rank``, held by ``local_rank``'s worker, are now ``slots`` (``(slot,
        generation, capacity, memory file)``): the standby of ``local_rank``, idle or started from now on, maps
        them ahead of its worker's restore (:mod:`aelastic.worker._checkpoint.premapped`). The pool keeps
        duplicates of the files (a slot's own may be closed when a larger one replaces it) until they change."""
        old = self._slots.pop(local_rank, None)
        if old is not None:
            old.close()
        files = self._slots[local_rank] = _SlotFiles(rank, [(*s[:3], os.dup(s[3])) for s in slots])
        standby = self._idle.get(local_rank)
        if standby is not None:
            standby.map_slots(files)

    def _take(self, local_rank: int, identity: tuple[object, ...]) -> _Standby | None:
        """An idle, live standby fit for ``identity``, out of the pool: ``local_rank``'s own, else any other's (the
        per-attempt variables, the local rank among them, arrive with the assignment, so a worker replaced alone
        need not wait for its own rank's refill)."""
        own = self._idle.get(local_rank)
        candidates = ([] if own is None else [(local_rank, own)]) + [i for i in self._idle.items() if i[1] is not own]
        for rank, standby in candidates:
            if standby.identity == identity and standby.popen.poll() is None:
                del self._idle[rank]
                standby.watch.cancel()  # from here on its exit is a worker's (or the retirement's)
                return standby
        return None

    async def refill(
        self, commands: Sequence[WorkerCommand], *, beside_workers: bool = True, quiet: bool = False
    ) -> None:
        """Have a standby, fit for the next attempt of each of ``commands``, started or kept idle.

        It first waits until every standby handed an attempt has finished its preload (or died): started beside it, the
        new standbys' imports would slow the workers' start even at idle CPU priority. A failure to start one (out of
        processes or fds) is logged: that worker starts cold next time. ``beside_workers``: the standbys preload at idle
        CPU priority (where they can leave it again), so that they never take a CPU from running workers; before the
        first attempt there are none to protect. ``quiet``: their sessions get the lowest CPU share, until
        :meth:`settled` (idle priority weighs only within a session, where the kernel groups sessions: see
        :mod:`aelastic.agent.shares`), for standbys started while restarted workers restore their state; only where the
        agent has ``CAP_SYS_ADMIN``.
        """
        while self._handed:
            with suppress(OSError):
                await anyio.wait_readable(self._handed[-1])  # the reply, or end of file if it died
            self._handed.pop().close()
        for command in commands:
            target = python_target(command.args)
            current = self._idle.get(command.local_rank)
            identity = None if target is None else _identity(target, command.env)
            if current is not None and current.popen.returncode is None and current.identity == identity:
                continue
            if current is not None:
                del self._idle[command.local_rank]
                await self._retire(current)
            if target is not None:
                await self._start(command.local_rank, target, command.env, idle=beside_workers, replacement=False,
                                  quiet=quiet)  # fmt: skip

    def settled(self) -> None:
        """The quiet standbys' sessions (see :meth:`refill`) back to a worker's CPU share."""
        for standby in self._idle.values():
            if standby.quiet:
                standby.quiet = False
                set_session_nice(0, standby.popen.pid)
                logger.debug("standby pid %d: its session back to a worker's CPU share", standby.popen.pid)

    async def _start(
        self,
        local_rank: int,
        target: PythonTarget,
        env: Mapping[str, str],
        *,
        idle: bool,
        replacement: bool,
        quiet: bool = False,
    ) -> None:
        try:
            standby = self._spawn(target, env, idle, replacement)
        except OSError as exc:
            logger.warning("could not start a standby for local_rank %d: %s", local_rank, exc)
            return
        # Only where the share can be given back at once: without CAP_SYS_ADMIN the kernel takes one change per
        # 0.1 s on the whole host, and a quiet standby handed an attempt would train at the lowest share.
        standby.quiet = quiet and shares_at_once() and set_session_nice(19, standby.popen.pid)
        self._idle[local_rank] = standby
        standby.warm(self._warm)
        if local_rank in self._slots:
            standby.map_slots(self._slots[local_rank])
        self._watchers.start_soon(self._watch, local_rank, standby)
        if self._reaper is not None:
            with anyio.CancelScope(shield=True):  # refill runs beside the workers and is cancelled with them
                await self._reaper.register(standby.popen.pid)
        logger.debug("standby for local_rank %d started (pid %d%s)", local_rank, standby.popen.pid,
                     ", its session at the lowest CPU share" if standby.quiet else "")  # fmt: skip

    async def _watch(self, local_rank: int, standby: _Standby) -> None:
        """Replace a standby that dies idle (once: a replacement that dies too leaves its rank to a cold start)."""
        with standby.watch:
            code = await wait_process(standby.popen)
        if standby.watch.cancel_called:
            return
        if self._idle.get(local_rank) is standby:
            del self._idle[local_rank]
        await self._retire(standby)
        then = "its worker will start cold" if standby.replacement else "replacing it"
        logger.warning("standby of local_rank %d (pid %d) exited with %d while idle: %s",
                       local_rank, standby.popen.pid, code, then)  # fmt: skip
        if not standby.replacement:
            await self._start(local_rank, standby.target, standby.env, idle=True, replacement=True)

    def _spawn(self, target: PythonTarget, env: Mapping[str, str], idle: bool, replacement: bool) -> _Standby:
        agent_end, standby_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        streams: list[int] = []
        try:
            # What the preload prints waits in memory files; the standby copies it to the worker's streams.
            streams = [os.memfd_create(f"aelastic-standby-{name}", os.MFD_CLOEXEC) for name in ("stdout", "stderr")]
            args = [target.python, *target.options, "-m", standby_child.__name__, str(standby_end.fileno()),
                    target.path0, ",".join(self._preload), "idle" if idle else "normal"]  # fmt: skip
            stable = {k: v for k, v in env.items() if k not in PER_ATTEMPT}
            popen = spawn_process(args, stable, streams[0], streams[1], (standby_end.fileno(),))
        except BaseException:
            agent_end.close()
            raise
        finally:
            standby_end.close()
            for fd in streams:
                os.close(fd)
        agent_end.setblocking(False)
        return _Standby(popen, agent_end, target, stable, replacement)

    async def _retire(self, standby: _Standby) -> None:
        """Kill a standby that will not be used (its process group: it has no children worth a grace) and reap it."""
        standby.watch.cancel()
        standby.control.close()
        with anyio.CancelScope(shield=True):
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(standby.popen.pid, signal.SIGKILL)
            await wait_process(standby.popen)
            if self._reaper is not None:
                try:
                    await self._reaper.unregister(standby.popen.pid)
                except ReaperError as exc:
                    logger.warning("%s", exc)

    async def aclose(self) -> None:
        """Retire every idle standby."""
        while self._slots:
            self._slots.popitem()[1].close()
        while self._handed:
            self._handed.pop().close()
        while self._idle:
            _, standby = self._idle.popitem()
            await self._retire(standby)


async def _send(control: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    while True:
        with suppress(BlockingIOError):
            socket.send_fds(control, [data], fds)
            return
        await anyio.wait_writable(control)


@asynccontextmanager
async def open_standbys(options: PrewarmOptions, reaper: Reaper | None) -> AsyncIterator[Standbys]:
    """A pool of standbys that preload ``torch`` (where importable) and ``options.modules``; every standby still
    idle is killed and reaped on exit, under a shield."""
    async with anyio.create_task_group() as watchers:
        standbys = Standbys((*DEFAULT_PRELOAD, *options.modules), reaper, watchers)
        try:
            yield standbys
        finally:
            with anyio.CancelScope(shield=True):
                await standbys.aclose()
