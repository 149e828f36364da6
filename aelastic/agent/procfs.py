"""What ``/proc`` says of a worker the agent supervises: its scheduler state, whether it has begun to exit, the CPU
time of its process tree, whether a signal kills it outright, and whether it holds a GPU.

Linux only, as the rest of supervision; a process that is gone reads as ``""`` and no time.
"""

from __future__ import annotations

import os
import signal
from contextlib import suppress
from pathlib import Path
from typing import Final, NamedTuple

__all__ = ["ProcessTimes", "dies_of", "exiting", "holds_device", "process_state", "tree_times", "wait_channel"]

_TICK: Final = 1.0 / os.sysconf("SC_CLK_TCK")
# The signals a stop sends whose default action ends the process (without a core dump).
_TERMINATING: Final = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL})
_PF_EXITING: Final = 0x4  # the kernel's task flag (include/linux/sched.h), in /proc/<pid>/stat's ninth field


class ProcessTimes(NamedTuple):
    """A process tree as the kernel accounts it: the root's state letter, the CPU seconds of the tree and the bytes
    its live processes moved through read and write calls."""

    state: str  # "R" running, "S" sleeping, "D" uninterruptible, "T" stopped, "Z" exited, "" gone
    cpu: float  # user + system time of the root, its live descendants and the children they reaped
    io: int = 0  # rchar + wchar of /proc/<pid>/io over the live tree (files, pipes, sockets)


def _read(path: str) -> str:
    """The text of a ``/proc`` file; ``""`` when its process is gone."""
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces and parentheses)."""
    stat = _read(f"/proc/{pid}/stat")
    return stat[stat.rindex(")") + 2 :].split() if stat else None


def process_state(pid: int) -> str:
    """The state letter of ``pid`` (``R``, ``S``, ``D``, ``T`` stopped, ``Z`` exited, ...); ``""`` if it is gone."""
    fields = _stat_fields(pid)
    return "" if not fields else fields[0]


def exiting(pid: int) -> bool:
    """Whether ``pid`` has begun to exit, or exited and is not reaped. The kernel marks a process exiting before it
    frees its memory and closes its files: a peer that saw its connections close finds it marked, though its pidfd
    is readable only once the teardown is over (a while for a large process on a busy machine)."""
    fields = _stat_fields(pid)
    return fields is not None and int(fields[6]) & _PF_EXITING != 0


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    return [int(child) for task in tasks for child in _read(f"/proc/{pid}/task/{task}/children").split()]


def tree_times(pid: int) -> ProcessTimes:
    """``pid``'s state, the CPU seconds its tree has used and the bytes it moved (a DataLoader's workers count as
    its worker's)."""
    fields = _stat_fields(pid)
    if not fields:
        return ProcessTimes("", 0.0)
    ticks = moved = 0
    pending, seen = [pid], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        stat = fields if current == pid else _stat_fields(current)
        if stat:
            # utime, stime, cutime, cstime: fields 14-17 of proc(5), 11-14 after the name.
            ticks += sum(int(value) for value in stat[11:15])
            moved += sum(int(line.split()[1]) for line in _read(f"/proc/{current}/io").splitlines()[:2])
            pending.extend(_children(current))
    return ProcessTimes(fields[0], ticks * _TICK, moved)


def wait_channel(pid: int) -> str:
    """The kernel function ``pid`` sleeps in (``/proc/<pid>/wchan``), ``""`` if running, gone or not shown."""
    channel = _read(f"/proc/{pid}/wchan")
    return "" if channel == "0" else channel


def dies_of(pid: int, signum: signal.Signals) -> bool:
    """Whether ``signum`` ends process ``pid`` on delivery: its default action terminates; the process runs or
    sleeps interruptibly (one stopped or in uninterruptible sleep takes it later, if ever; one that exited already
    has a status of its own); no tracer may intercept it; and its main thread neither catches, ignores nor blocks
    it."""
    status = _read(f"/proc/{pid}/status")
    fields = {key: value.strip() for key, _, value in (line.partition(":") for line in status.splitlines())}
    if signum not in _TERMINATING or not fields.get("State", "").startswith(("R", "S")):
        return False
    if fields.get("TracerPid", "0") != "0":
        return False
    if signum == signal.SIGKILL:
        return True
    bit = 1 << (signum - 1)
    return not any(int(fields.get(mask, "0"), 16) & bit for mask in ("SigBlk", "SigIgn", "SigCgt"))


def holds_device(pid: int) -> bool:
    """Whether process ``pid`` has an NVIDIA device open (a CUDA context: GPU memory to free at its exit)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with suppress(OSError):  # closed meanwhile
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                return True
    return False
