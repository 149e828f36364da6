"""The floor of a store server written in Python: ``benchmarks/store_ops.py``'s floor systems.

    python -m benchmarks.store_floor          # prints its port, serves until stdin closes

Not a store: it parses every request with aelastic's own parser (a server must, to know the key and where the
next request starts) and answers each with a fixed reply of the right shape (GET: ``"0"``, ADD: ``1``, CHECK:
ready, WAIT: stop waiting, PING: the nonce, SET: nothing), one write per chunk received, from a plain asyncio
protocol on the loop that ``AELASTIC_UVLOOP`` picks (as ``aelastic store``). No table, no waiters, no counters, no
limits beyond the parser's. Whatever torch's clients lose against this server in a round trip (GET, ADD), no store
in Python on that loop can win back: it is the event loop's callback, the parse and the write, which every request
costs at the least. (Not so for SET, which has no reply: SETs arrive in runs, and aelastic's store parses a run
into its table in one loop without a request object each, which this floor does not.)
"""

from __future__ import annotations

import asyncio
import struct
import sys

import anyio

from aelastic._eventloop import run_options
from aelastic.store import wire

_U64, _I64, _U32 = struct.Struct("<Q"), struct.Struct("<q"), struct.Struct("<I")
_FIXED: dict[type, bytes] = {
    wire.Validate: b"",
    wire.Set: b"",
    wire.Get: _U64.pack(1) + b"0",
    wire.Add: _I64.pack(1),
    wire.Check: bytes([wire.CheckResponse.READY]),
    wire.Wait: bytes([wire.WaitResponse.STOP_WAITING]),
}


class _Floor(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.parser = wire.RequestParser()

    def data_received(self, data: bytes) -> None:
        self.parser.receive_data(data)
        out = bytearray()
        while (request := self.parser.next_request()) is not wire.NEED_DATA:
            kind = type(request)
            out += _U32.pack(request.nonce) if kind is wire.Ping else _FIXED[kind]  # type: ignore[union-attr]
        if out:
            self.transport.write(bytes(out))


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Floor, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the harness closes stdin
    server.close()


def main() -> None:
    anyio.run(_serve, backend="asyncio", backend_options=run_options("asyncio"))


if __name__ == "__main__":
    main()
