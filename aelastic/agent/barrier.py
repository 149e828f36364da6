"""A barrier of the round's members in the round's store: the exit barrier and the closing barrier of the agent."""

from __future__ import annotations

import logging

import anyio

from ..errors import StoreConnectionError
from ..rendezvous.api import RendezvousHandler, RendezvousInfo

__all__ = ["members_barrier"]

logger = logging.getLogger("aelastic.agent.agent")  # the agent's own log lines


async def members_barrier(info: RendezvousInfo, key: str, handler: RendezvousHandler, role: str) -> None:
    """Arrive at ``key`` and wait until every rank of the round still a member has arrived: a node lost meanwhile
    (``handler``'s membership) is not waited for.

    Raises:
        StoreConnectionError: the round store was lost (not wrapped in an exception group).
    """
    await info.store.set(f"{key}/{info.rank}", b"")
    ranks = frozenset(range(info.world_size))
    if await info.store.check([f"{key}/{rank}" for rank in sorted(ranks)]):
        return  # the last to arrive (a single node always) waits for nothing and watches no membership
    while True:
        shrunk = False
        lost: StoreConnectionError | None = None
        async with anyio.create_task_group() as tg:

            async def watch(known: frozenset[int]) -> None:
                nonlocal ranks, shrunk
                try:
                    ranks = await handler.wait_for_member_ranks(known)
                except StoreConnectionError:
                    return  # the barrier's own wait, on the same store, tells what that means
                shrunk = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch, ranks)
            try:
                await info.store.wait([f"{key}/{rank}" for rank in sorted(ranks)])
            except StoreConnectionError as exc:
                lost = exc
            tg.cancel_scope.cancel()
        if lost is not None:
            raise lost
        if not shrunk:
            return
        logger.warning("[%s] %s: waiting only for the ranks still members: %s", role, key, sorted(ranks))
