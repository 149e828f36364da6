"""What the store tests share: the backends a server runs on, its connection count, whether it closed a stream,
and a gloo worker."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.abc
import pytest

from aelastic.store.server import StoreServer

# Where the store server's tests run: each transport, and asyncio's on both loops it meets (its own; uvloop, the
# ``fast`` extra, where a connection is a plain protocol instead of a buffered one).
SERVER_BACKENDS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param("trio", id="trio"),
]


@pytest.fixture(params=SERVER_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """The store modules' backends (import it into a test module to override conftest's)."""
    return request.param


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
