"""Processes and ports as the tests check them."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import anyio

T = TypeVar("T")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is neither a zombie nor dead (a zombie's pid exists until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def free_port() -> int:
    """A port nobody listens on now, chosen by the kernel. Only for a peer that must be told a port in advance (a
    static rank 0, torchrun's endpoint): the window between this close and that bind is short."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair(hosts: Iterable[str]) -> int:
    """A port P (the kernel's pick) such that every one of ``hosts`` can listen on P and P + 1 now: an etcd
    member's client and peer ports."""
    hosts = tuple(hosts)
    while True:
        port = free_port()
        if port < 65534 and all(listenable(h, p) for h in hosts for p in (port, port + 1)):
            return port


def listenable(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now, as servers bind (``SO_REUSEADDR``: the connections a
    stopped server leaves in TIME_WAIT do not hold its port)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
        except OSError:
            return False
    return True


async def wait_gone(pids: Iterable[int]) -> None:
    """Wait until every pid has exited (zombies count as gone). Uses pidfds: works for processes not our own."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            await anyio.wait_readable(fd)
        finally:
            os.close(fd)


def poll_until(what: str, check: Callable[[], T | None], timeout: float, interval: float, logs: Callable[[], str]) -> T:
    """``check()`` every ``interval`` seconds until it returns something truthy, for states that offer no event to
    await from outside (a scheduler's, another network namespace's); on timeout fail with ``logs()``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s\n{logs()}")
        time.sleep(interval)
