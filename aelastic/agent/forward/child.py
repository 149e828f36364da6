"""The witness: a process started as a worker is, that reports every forwarded signal it receives.

Run by path as ``python -I -S child.py SIGNUM...`` (standard library only; nothing of aelastic is importable),
under the parent-death signal, in a session of its own: a child of the agent exactly as each worker is. Whoever
signals every process of the agent's job step (Slurm's proctrack, a cgroup's kill) signals it too; whoever signals
the agent alone (a batch script's ``kill``, a user) does not. It blocks the signals (the agent spawns it with them
blocked already, so none is lost or fatal while it starts) and writes one line per signal received on stdout:
``SIGNUM SENDER_PID\\n``. It runs until it is killed.
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str]) -> None:
    signums = {int(arg) for arg in argv}
    signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    out = sys.stdout.fileno()
    while True:
        info = signal.sigwaitinfo(signums)
        os.write(out, f"{info.si_signo} {info.si_pid}\n".encode())


if __name__ == "__main__":
    main(sys.argv[1:])
