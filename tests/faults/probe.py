"""The fault suite's window into a c10d rendezvous store, run inside a host's namespace.

    probe.py watch ENDPOINT RUN_ID    one JSON line per state change: version, round, complete, participants...
    probe.py arrived ENDPOINT KEY N   one line: how many of ranks 0..N-1 arrived at the agent barrier KEY

``arrived`` only reads (CHECK): writing a key that the barrier's nodes wait on would disturb what it observes.

``watch`` waits on the backend's change notifications (the same keys the handlers wait on) and, since join
requests appended to the state key notify nobody, re-reads at least every 0.1 s; it runs until killed.
"""

from __future__ import annotations

import json
import sys

import anyio

from aelastic._net import parse_endpoint
from aelastic.rendezvous.backends.store import StoreBackend
from aelastic.rendezvous.codec import decode_state
from aelastic.store.client import open_store_client


async def watch(endpoint: str, run_id: str) -> None:
    host, port = parse_endpoint(endpoint, None)
    async with open_store_client(host, port) as client:
        backend = StoreBackend(client, run_id)
        await backend.initialize()
        last = None
        while True:
            seen = await backend.get_state()
            state = decode_state(seen.data) if seen.data is not None else None
            line = {
                "version": seen.version,
                "round": state and state.round,
                "complete": bool(state and state.complete),
                "participants": [n.id for n in state.participants] if state else [],
                # join requests not yet folded into the state (appended to the key; no change notification)
                "pending": [r.decode(errors="replace") for r in seen.pending],
            }
            if line != last:
                print(json.dumps(line), flush=True)
                last = line
            # Versions notify; appended join requests do not, so re-read at least every 0.1 s.
            with anyio.move_on_after(0.1):
                await backend.wait_for_change(seen)


async def arrived(endpoint: str, key: str, world_size: str) -> None:
    host, port = parse_endpoint(endpoint, None)
    with anyio.fail_after(30):  # the store may be gone: fail, do not retry forever
        async with open_store_client(host, port) as client:
            print(sum([await client.check([f"{key}/{rank}"]) for rank in range(int(world_size))]), flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    anyio.run({"watch": watch, "arrived": arrived}[command], *args)
