"""The guard of a job's etcd member: ``python -I -S .../aelastic/etcd/guard.py DATA_DIR ETCD [ARG...]``.

It starts etcd (its log goes to the guard's stderr, which the agent reads), and leaves nothing behind whatever ends:
when etcd exits, when the agent asks (SIGTERM; SIGUSR1: at once, etcd killed without its graceful stop), or when the
agent is gone by any death (fd 0 is the read end of a pipe whose only write end the agent holds: end of file), it stops
etcd (SIGTERM, a grace, SIGKILL), removes the member's data directory (and the agent's lock file beside it), and exits
with etcd's status (0 where it stopped etcd). etcd runs under the parent-death signal (SIGKILL), so it dies with a guard
that is killed outright; in a session of its own, so a terminal's Ctrl-C reaches the agent and the guard (which ignores
it), and the agent's stop is the one that acts.

It blocks in ``poll(2)`` on the pipe, a pidfd of etcd and a wake-up pipe for its signals: no polling, no timers but
the stop's grace. Standard library only (the child-side rule of :mod:`aelastic.agent`), run by path.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys

GRACE = 3.0  # etcd stops in well under a second; the agent's own grace for the guard is longer
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in etcd's process between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: guard.py DATA_DIR ETCD [ARG...]", file=sys.stderr)  # noqa: T201
        return 2
    data_dir, command = argv[0], argv[1:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, lambda *_: None)  # a handler, so the wake-up fd hears of it
    try:
        etcd = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_die_with_parent,  # safe: the guard has one thread
        )  # fmt: skip
    except OSError as exc:
        print(f"aelastic etcd guard: cannot start {command[0]}: {exc}", file=sys.stderr)  # noqa: T201
        _remove(data_dir)
        return 127
    exited = os.pidfd_open(etcd.pid)
    poller = select.poll()
    for fd in (0, exited, wake_read):
        poller.register(fd, select.POLLIN)
    stopped = at_once = False
    while not stopped and etcd.poll() is None:
        for fd, _ in poller.poll():
            if fd == 0 and not os.read(0, 4096):  # the agent closed its end, or died
                stopped = True
            elif fd == wake_read:
                at_once = signal.SIGUSR1 in os.read(wake_read, 64)  # the wake-up fd carries the signals' numbers
                stopped = True
            elif fd == 0:
                continue  # nothing is ever written; read and ignored
    if stopped and etcd.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            if at_once:
                etcd.kill()
            else:
                etcd.terminate()
        try:
            etcd.wait(GRACE)
        except subprocess.TimeoutExpired:
            etcd.kill()
    status = etcd.wait()
    _remove(data_dir)
    return 0 if stopped else (status if status >= 0 else 128 - status)


def _remove(data_dir: str) -> None:
    """The data directory, and the lock file the agent keeps beside it (:mod:`aelastic.etcd.datadirs`): the agent
    may be gone."""
    shutil.rmtree(data_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(f"{data_dir}.lock")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
