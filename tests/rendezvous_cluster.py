"""Test helper: a cluster of rendezvous nodes run as tasks, each killable like a process (its scope cancelled,
so its heartbeats stop and it writes nothing more)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from aelastic.errors import RendezvousError
from aelastic.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousParameters

Opener = Callable[[RendezvousParameters], AbstractAsyncContextManager[RendezvousHandler]]

FAST = {"keep_alive_interval": 0.1, "keep_alive_max_attempt": 3, "heartbeat_timeout": 5}


@dataclass
class Node:
    name: str
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    handler: RendezvousHandler | None = None
    info: RendezvousInfo | None = None
    error: RendezvousError | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    again: anyio.Event = field(default_factory=anyio.Event)
    rounds: list[RendezvousInfo] = field(default_factory=list)
    completed_at: float = 0.0

    def kill(self) -> None:
        self.scope.cancel()

    def rejoin(self) -> None:
        """Ask the node to run next_rendezvous again (as an agent does after a membership change)."""
        self.done = anyio.Event()
        self.again.set()

    @property
    def h(self) -> RendezvousHandler:
        assert self.handler is not None
        return self.handler


class Cluster:
    def __init__(self, tg: anyio.abc.TaskGroup, opener: Opener, run_id: str, **defaults: Any) -> None:
        self._tg = tg
        self._opener = opener
        self._run_id = run_id
        self._defaults = {**FAST, **defaults}  # a backend may need slower liveness (etcd: whole-second leases)
        self.nodes: list[Node] = []

    @property
    def keep_alive_interval(self) -> float:
        return float(self._defaults["keep_alive_interval"])

    @property
    def grace(self) -> float:
        """How long a silent node stays a member: keep_alive_interval × keep_alive_max_attempt."""
        return self.keep_alive_interval * int(self._defaults["keep_alive_max_attempt"])

    async def start(self, min_nodes: int, max_nodes: int, **conf: Any) -> Node:
        node = Node(f"n{len(self.nodes)}")
        self.nodes.append(node)
        conf = {**self._defaults, **conf}
        backend, endpoint = conf.pop("backend", "c10d"), conf.pop("endpoint", "")
        params = RendezvousParameters(backend, endpoint, self._run_id, min_nodes, max_nodes, **conf)
        await self._tg.start(self._run, node, params)
        return node

    async def _run(self, node: Node, params: RendezvousParameters, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with node.scope:
            async with self._opener(params) as handler:
                node.handler = handler
                task_status.started()
                while True:
                    try:
                        node.info = await handler.next_rendezvous()
                        node.rounds.append(node.info)
                        node.completed_at = anyio.current_time()
                    except RendezvousError as exc:
                        node.error = exc
                        node.done.set()
                        return
                    node.done.set()
                    await node.again.wait()
                    node.again = anyio.Event()


@asynccontextmanager
async def open_cluster(opener: Opener, run_id: str, **defaults: Any) -> AsyncIterator[Cluster]:
    async with anyio.create_task_group() as tg:
        yield Cluster(tg, opener, run_id, **defaults)
        tg.cancel_scope.cancel()
