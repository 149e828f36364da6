"""A store server and a client in one event loop: what every aelastic node runs for its rendezvous.

python examples/store_demo.py            # asyncio
python examples/store_demo.py trio       # trio
"""

from __future__ import annotations

import sys

import anyio

from aelastic.store.client import open_store_client
from aelastic.store.server import open_store_server


async def main() -> None:
    async with open_store_server("localhost", 0) as server, open_store_client("localhost", server.port) as client:
        print(f"store listening on localhost:{server.port}")
        await client.set("greeting", "hello")
        print("get greeting ->", (await client.get("greeting")).decode())
        print("add counter +5 ->", await client.add("counter", 5))

        async with anyio.create_task_group() as tg:

            async def waiter() -> None:
                started = anyio.current_time()
                value = await client.get("late-key")  # a server-side WAIT, woken by the set below
                print(f"waiter woke after {1000 * (anyio.current_time() - started):.1f} ms with {value!r}")

            tg.start_soon(waiter)
            await anyio.sleep(0.1)
            await client.set("late-key", "arrived")
        print("server statistics:", server.statistics())


if __name__ == "__main__":
    anyio.run(main, backend=sys.argv[1] if len(sys.argv) > 1 else "asyncio")
