"""The handshake deadlines of one store server's connections, sans-IO: one queue, one timer for the earliest.

Every connection has the same timeout, so arrival order is deadline order: the queue is a deque, not a heap, and a
transport needs one timer (a loop timer on asyncio, a cancel scope's deadline on trio) instead of one per connection:
a burst of 16,384 connections would otherwise make 16,384 timers, each created and cancelled within milliseconds.
The transport owns the clock and the timer; it says when a connection was accepted (:meth:`add`) and when the timer
fired (:meth:`expire`), and arms the timer for the deadline either returns.
"""

from __future__ import annotations

from collections import deque

from .table import Connection, StoreTable, log_handshake_timeout

__all__ = ["HandshakeDeadlines"]


class HandshakeDeadlines:
    """The connections of ``table`` that must finish their handshake within ``timeout`` seconds of ``add``."""

    __slots__ = ("_queue", "_table", "timeout")

    def __init__(self, table: StoreTable, timeout: float) -> None:
        self._table = table
        self.timeout = timeout
        self._queue: deque[tuple[float, Connection]] = deque()

    def __repr__(self) -> str:
        return f"<HandshakeDeadlines timeout={self.timeout:g}s pending={len(self._queue)}>"

    def add(self, conn: Connection, now: float) -> float | None:
        """Start ``conn``'s handshake clock at ``now``; return its deadline where the timer must be armed for it
        (nothing else was pending), else None (the timer is armed for an earlier one)."""
        deadline = now + self.timeout
        self._queue.append((deadline, conn))
        return deadline if len(self._queue) == 1 else None

    def expire(self, now: float) -> float | None:
        """Close (``abort``, with a warning) every open connection past its deadline that has not finished its
        handshake; return the next deadline to arm the timer for, or None when none is pending."""
        queue = self._queue
        connections = self._table.connections  # a connection already closed has left it: nothing to say
        while queue and queue[0][0] <= now:
            _, conn = queue.popleft()
            if not conn.established and conn in connections:
                log_handshake_timeout(conn, self.timeout)
                conn.abort()
        return queue[0][0] if queue else None

    def clear(self) -> None:
        self._queue.clear()
