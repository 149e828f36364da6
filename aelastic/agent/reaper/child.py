"""The reaper sidecar: ``python -I -S .../aelastic/agent/reaper/child.py``. Kills registered process groups when
the agent is gone (the child side of :mod:`aelastic.agent.reaper`, run by path).

Protocol: fd 0 is the read end of a pipe whose only write end the agent holds. The agent writes ASCII lines
``+<pgid>\\n`` (register) and ``-<pgid>\\n`` (unregister), each well under ``PIPE_BUF`` so every write is atomic.
End of file means the agent closed the pipe, cleanly or by dying (the kernel closes a SIGKILLed process's fds):
the reaper then sends SIGKILL to every process group still registered and exits 0. A clean agent has stopped and
unregistered its groups by then, so the reaper finds nothing to kill.

It blocks in ``read(2)``: no polling, no timers. It ignores SIGINT, SIGTERM and SIGHUP, because it must outlive
the agent long enough to act (a terminal's Ctrl-C reaches every process of the foreground group; it also runs in a
session of its own). It imports nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def _kill_group(pgid: int) -> None:
    # Already gone, or (EPERM) the id was reused by a group we may not touch.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def main() -> int:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    registered: set[int] = set()
    pending = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if len(line) < 2 or line[:1] not in (b"+", b"-"):
                print(f"aelastic reaper: ignoring malformed line {line!r}", file=sys.stderr)  # noqa: T201
                continue
            try:
                pgid = int(line[1:])
            except ValueError:
                print(f"aelastic reaper: ignoring malformed line {line!r}", file=sys.stderr)  # noqa: T201
                continue
            if line[:1] == b"+":
                registered.add(pgid)
            else:
                registered.discard(pgid)
    for pgid in registered:
        _kill_group(pgid)
    return 0


if __name__ == "__main__":
    code = main()
    # The agent waits for this exit at the end of every run, so the interpreter's teardown is skipped: nothing is
    # left to clean up; only stderr may hold a warning.
    sys.stderr.flush()
    os._exit(code)
