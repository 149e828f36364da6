"""Processes and ports as the tests check them."""

from __future__ import annotations

import socket


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
