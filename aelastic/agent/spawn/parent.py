"""The agent's side of starting a worker: the command, the spawn under the parent-death signal, the exit's wait.

Every process the agent starts (workers, standbys, sidecars) is spawned with ``subprocess.Popen`` from the
event-loop thread, through util-linux ``setpriv --pdeathsig KILL --`` when it exists, else through
:mod:`aelastic.agent.spawn.child` (found by path, run with ``python -I -S``: it loads ctypes, which the agent must
not pay for). Its exit is awaited through a pidfd (``anyio.wait_readable``, then ``Popen.poll`` reaps) and its
pipes read with ``anyio.wait_readable`` + ``os.read``: the same code on asyncio and trio, no threads, no polling.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import termios
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple

import anyio
import anyio.abc
import anyio.lowlevel

from ...errors import ConfigurationError

__all__ = [
    "ATTEMPT_VARIABLES",
    "FdVar",
    "PipeReader",
    "WorkerCommand",
    "WorkerHook",
    "WorkerProcess",
    "output_fds",
    "signal_group",
    "spawn_process",
    "wait_process",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerCommand:
    """One local worker to start.

    Attributes:
        local_rank: rank on this node.
        global_rank: rank in the job.
        args: the command line (``args[0]`` looked up on ``PATH`` of ``env``).
        env: the worker's full environment (nothing is inherited).
        pass_fds: file descriptors the worker inherits (e.g. the pipe of :mod:`~aelastic.agent.stacks.fallback`).
    """

    local_rank: int
    global_rank: int
    args: tuple[str, ...]
    env: Mapping[str, str]
    pass_fds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.args:
            raise ConfigurationError(f"worker local_rank {self.local_rank}: empty command line")
        if self.local_rank < 0 or self.global_rank < 0:
            raise ConfigurationError(
                f"worker local_rank {self.local_rank}, rank {self.global_rank}: ranks must be >= 0"
            )


@dataclass(frozen=True, slots=True)
class FdVar:
    """File descriptors a worker inherits, named to it by the variable ``name``: ``template`` formatted with their
    numbers in the worker (the same as the agent's when spawned, others when handed to a standby)."""

    name: str
    template: str
    fds: tuple[int, ...]

    def value(self, numbers: Sequence[int]) -> str:
        return self.template.format(*numbers)


# The variables of a worker's environment that the agent sets for each attempt (ElasticAgent._environment): a
# standby starts without them (aelastic.agent.prewarm), and a survivor of an in-process restart takes the next
# attempt's (aelastic.agent.restart).
ATTEMPT_VARIABLES: Final = frozenset({
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE",
    "AELASTIC_MEMBERSHIP_RESTARTS",
})  # fmt: skip


class WorkerProcess(NamedTuple):
    """A started worker, as supervision shows it to its hooks: ``pid`` leads the worker's process group."""

    local_rank: int
    global_rank: int
    pid: int


# A hook of run_workers: called with the workers it concerns (see run_workers' ``watch`` and ``before_kill``).
WorkerHook = Callable[[Sequence[WorkerProcess]], Coroutine[Any, Any, None]]

# The shim, found by path (not imported: it loads ctypes, and it runs in the worker's place).
_SHIM = Path(__file__).with_name("child.py")


@functools.cache
def _pdeathsig_prefix() -> tuple[str, ...]:
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return (setpriv, "--pdeathsig", "KILL", "--")
    return (sys.executable, "-I", "-S", str(_SHIM), str(os.getpid()))


def spawn_process(
    args: Sequence[str], env: Mapping[str, str], stdout: int, stderr: int, pass_fds: Sequence[int] = ()
) -> subprocess.Popen[bytes]:
    """Start ``args`` as a worker starts, from the calling (event-loop) thread: under the parent-death signal, the
    leader of a session of its own, with ``env`` only, ``stdout`` and ``stderr``, and ``pass_fds`` beside them."""
    return subprocess.Popen(
        [*_pdeathsig_prefix(), *args],
        stdout=stdout,
        stderr=stderr,
        env=env,
        start_new_session=True,
        close_fds=True,
        pass_fds=tuple(pass_fds),
    )


async def wait_process(popen: subprocess.Popen[bytes], pidfd: int | None = None) -> int:
    """Wait for a child's exit through a pidfd (``pidfd``, else one opened here) and reap it with ``Popen.poll``,
    so ``subprocess`` never reaps a reused pid later."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    if (code := popen.poll()) is not None:
        return code
    own = pidfd is None
    fd = os.pidfd_open(popen.pid) if pidfd is None else pidfd  # not reaped yet: no ESRCH
    try:
        while (code := popen.poll()) is None:
            await anyio.wait_readable(fd)
    finally:
        if own:
            os.close(fd)
    return code


def signal_group(pgid: int, signum: signal.Signals) -> None:
    """Send ``signum`` to process group ``pgid``; a group that is empty, or no longer ours, is left alone."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass  # the group is empty: leader reaped, no descendant left
    except PermissionError:
        # The leader is reaped and its id now names somebody else's group: nothing of ours is in it.
        logger.debug("not signalling process group %d: not ours any more", pgid)


class PipeReader(anyio.abc.ByteReceiveStream):
    """The agent's end of a child's pipe (non-blocking fd, awaited with ``wait_readable``). Its reader says how
    many bytes it has handled (:meth:`handled`), so that others can wait until what the child wrote before some
    moment has been handled (:meth:`pending`, :meth:`wait_handled`)."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd
        self._handled = 0
        self._progress: anyio.Event | None = None

    def pending(self) -> int:
        """Bytes written to the pipe and not received yet (0 once closed): with :meth:`wait_handled`, everything
        written so far is handled once ``wait_handled(handled_so_far + pending())`` returns."""
        if self._fd < 0:
            return 0
        try:
            count: int = struct.unpack("i", fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return 0
        return count

    @property
    def handled_so_far(self) -> int:
        return self._handled

    async def wait_handled(self, count: int) -> None:
        """Wait until ``count`` bytes in all were handled, or the stream ended."""
        while self._handled < count and self._fd >= 0:
            self._progress = self._progress or anyio.Event()
            await self._progress.wait()

    def handled(self, count: int) -> None:
        """The reader handled ``count`` more bytes (0: the stream ended)."""
        self._handled += count
        if self._progress is not None:
            self._progress.set()
            self._progress = None

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._fd < 0:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                continue
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                data = b""  # a pseudo-terminal whose every writer has closed: its end of file
            if not data:
                self.handled(0)
                raise anyio.EndOfStream
            return data

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        self.handled(0)

    async def aclose(self) -> None:
        self.close()
        await anyio.lowlevel.checkpoint()


def output_fds(terminal_size: tuple[int, int] | None) -> tuple[int, int]:
    """The (agent's, worker's) ends of one worker stream: a pipe, or a pseudo-terminal of ``(rows, columns)``.

    The pseudo-terminal's output processing is off, so the worker's bytes arrive as written ("\\n" is not made
    "\\r\\n"). It is not the worker's controlling terminal (the worker starts a new session and never opens it).
    """
    if terminal_size is None:
        return os.pipe()
    agent_end, worker_end = os.openpty()
    try:
        attributes = termios.tcgetattr(worker_end)
        attributes[1] &= ~termios.OPOST  # oflag
        termios.tcsetattr(worker_end, termios.TCSANOW, attributes)
        rows, columns = terminal_size
        fcntl.ioctl(worker_end, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    except BaseException:
        os.close(agent_end)
        os.close(worker_end)
        raise
    return agent_end, worker_end
