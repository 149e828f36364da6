"""Parent-death-signal shim: ``python -I -S .../aelastic/agent/spawn/child.py <parent_pid> <cmd> [args...]``.

Child side of :mod:`aelastic.agent.spawn`, run by path in the worker's place. Used only where util-linux's
``setpriv`` is missing. It asks the kernel to SIGKILL this process when its parent (the agent) dies
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``, which survives ``execve``), checks that the parent did not already die
before that call (then the signal would never come: exit at once), and ``execvp``s the command, so the worker
keeps this pid. A command that cannot be executed exits 127, like a shell and like ``setpriv``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print(f"usage: python -I -S {__file__} <parent_pid> <cmd> [args...]", file=sys.stderr)  # noqa: T201
        return 2
    parent = int(argv[0])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        print(f"aelastic: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}", file=sys.stderr)  # noqa: T201
        return 127
    if os.getppid() != parent:
        return 128 + int(signal.SIGKILL)  # the agent died before the signal was armed: behave as if it fired
    sys.stdout.flush()
    try:
        os.execvp(argv[1], argv[1:])
    except OSError as exc:
        print(f"aelastic: failed to execute {argv[1]}: {exc.strerror}", file=sys.stderr)  # noqa: T201
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
