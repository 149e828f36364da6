"""Checks the store tests share: a server's connection count, whether it closed a stream, and a gloo worker."""

from __future__ import annotations

import anyio
import anyio.abc

from aelastic.store.server import StoreServer

# A torch worker that joins the group through env:// (MASTER_ADDR/PORT, RANK, WORLD_SIZE) and all-reduces.
GLOO_WORKER = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank={dist.get_rank()} sum={t.item():g}", flush=True)
dist.destroy_process_group()
"""


async def wait_for_connections(server: StoreServer, count: int) -> None:
    with anyio.fail_after(10):
        while server.statistics().connections != count:  # noqa: ASYNC110 - server state has no event to wait on
            await anyio.sleep(0.005)


async def closed_by_server(stream: anyio.abc.SocketStream, within: float = 10) -> bool:
    """Whether the server closes ``stream`` within ``within`` seconds (read to EOF; replies are skipped)."""
    with anyio.move_on_after(within):
        try:
            while await stream.receive():
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return True
    return False
