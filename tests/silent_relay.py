"""Test helper: a TCP relay that can go silent, as a network does when a host loses power: while silent it keeps
every connection open, accepts new ones, and forwards nothing in either direction (no FIN, no RST)."""

from __future__ import annotations

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

    def silence(self) -> None:
        self.audible = anyio.Event()

    def restore(self) -> None:
        self.audible.set()

    async def _pipe(self, source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream) -> None:
        try:
            async for chunk in source:
                await self.audible.wait()  # silent: the bytes go nowhere until (unless) the network is back
                await sink.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    async def _serve(self, client: anyio.abc.SocketStream) -> None:
        server = await anyio.connect_tcp("127.0.0.1", self.target_port)
        async with client, server, anyio.create_task_group() as tg:
            tg.start_soon(self._pipe, client, server)
            await self._pipe(server, client)
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
