"""Test helper: a TCP relay that can go silent, as a network does when a host loses power: while silent it keeps
every connection open, accepts new ones, and forwards nothing in either direction (no FIN, no RST)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc


class Relay:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.audible = anyio.Event()
        self.audible.set()
        self._markers: tuple[bytes, ...] = ()

    def silence(self) -> None:
        self.audible = anyio.Event()

    def silence_on(self, *markers: bytes) -> None:
        """Go silent as soon as a client sends a chunk that holds every one of ``markers`` (that chunk is not
        forwarded): the network dies with exactly that request in flight."""
        self._markers = markers

    def restore(self) -> None:
        self.audible.set()

    async def _pipe(self, source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream, *, upstream: bool) -> None:
        try:
            async for chunk in source:
                if upstream and self._markers and all(marker in chunk for marker in self._markers):
                    self._markers = ()
                    self.silence()
                await self.audible.wait()  # silent: the bytes go nowhere until (unless) the network is back
                await sink.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    async def _serve(self, client: anyio.abc.SocketStream) -> None:
        server = await anyio.connect_tcp("127.0.0.1", self.target_port)
        async with client, server, anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(self._pipe, client, server, upstream=True))
            await self._pipe(server, client, upstream=False)
            tg.cancel_scope.cancel()


@asynccontextmanager
async def open_relay(target_port: int) -> AsyncIterator[Relay]:
    """A relay on a kernel-chosen port of 127.0.0.1 to ``127.0.0.1:target_port``."""
    async with anyio.create_task_group() as tg:
        relay = Relay(target_port)
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        relay.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        tg.start_soon(listener.serve, relay._serve)
        yield relay
        tg.cancel_scope.cancel()
