"""A rendezvous node as its own OS process (used by test_rendezvous_processes.py).

argv: BACKEND ENDPOINT RUN_ID MIN MAX [KEY=VALUE ...]  (rdzv-conf keys)
Prints one JSON line per event: {"event": "complete", "rank", "world_size", "round"} then, when its round must be
redone, {"event": "change", "reason"}; it then rejoins, until killed.
"""

from __future__ import annotations

import json
import sys

import anyio

from aelastic.rendezvous.api import RendezvousParameters
from aelastic.rendezvous.registry import open_rendezvous


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main(backend: str, endpoint: str, run_id: str, min_nodes: str, max_nodes: str, *conf: str) -> None:
    params = RendezvousParameters(
        backend, endpoint, run_id, int(min_nodes), int(max_nodes), **dict(kv.split("=", 1) for kv in conf)
    )
    async with open_rendezvous(params) as handler:
        while True:
            info = await handler.next_rendezvous()
            emit(event="complete", rank=info.rank, world_size=info.world_size, round=info.round)
            emit(event="change", reason=await handler.wait_for_membership_change())


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:])
