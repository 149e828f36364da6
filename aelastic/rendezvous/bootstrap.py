"""The workers' store of each round: fresh, empty, served by the round's rank-0 node in its own loop.

torch's workers in agent-store mode (``TORCHELASTIC_USE_AGENT_STORE=True``) connect to ``MASTER_ADDR:MASTER_PORT``
and write gloo/NCCL addresses under fixed keys, with no per-attempt prefix. A restarted attempt that reuses the
previous attempt's store reads dead peers' addresses. So every round gets a new server (a new kernel-chosen
port); the previous round's server is stopped when the next round completes.
"""

from __future__ import annotations

from typing import Final

import anyio
import anyio.abc

from ..store.api import Store
from ..store.server import ServerSettings, open_store_server
from .api import RendezvousStoreInfo

__all__ = ["BootstrapStores"]

_MASTER_ADDR: Final = "MASTER_ADDR"
_MASTER_PORT: Final = "MASTER_PORT"


class BootstrapStores:
    """Serves (on rank 0) and looks up (everywhere) the workers' store of each round."""

    def __init__(self, task_group: anyio.abc.TaskGroup, host: str) -> None:
        self.host = host
        self._task_group = task_group
        self._scope: anyio.CancelScope | None = None

    def __repr__(self) -> str:
        return f"<BootstrapStores host={self.host!r} serving={self._scope is not None}>"

    async def publish(self, round_store: Store, rank: int) -> RendezvousStoreInfo:
        """Start this round's server if ``rank`` is 0 (stopping the last one) and return its address."""
        self.stop()
        if rank == 0:
            self._scope, port = await self._task_group.start(self._serve)
            await round_store.multi_set([_MASTER_ADDR, _MASTER_PORT], [self.host, str(port)])
        addr, port_text = await round_store.multi_get([_MASTER_ADDR, _MASTER_PORT])
        return RendezvousStoreInfo(addr.decode(), int(port_text))

    def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None

    async def _serve(
        self, *, task_status: anyio.abc.TaskStatus[tuple[anyio.CancelScope, int]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        with anyio.CancelScope() as scope:
            async with open_store_server(self.host, 0, ServerSettings(name="workers")) as server:
                task_status.started((scope, server.port))
                await anyio.sleep_forever()
