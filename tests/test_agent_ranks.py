"""Rank assignment: torch's arithmetic (pure) and its store exchange over a real store."""

from __future__ import annotations

import anyio
import pytest

from aelastic.agent.ranks import RankAssignment, RoleInfo, assign, exchange_ranks
from aelastic.config.environ import workers_identical
from aelastic.store.client import open_store_client
from aelastic.store.server import open_store_server


def test_one_role_is_group_rank_order() -> None:
    infos = [RoleInfo("trainer", 1, 2), RoleInfo("trainer", 0, 2), RoleInfo("trainer", 2, 2)]
    assert assign(infos) == [RankAssignment(0, 6, 0, 6), RankAssignment(2, 6, 2, 6), RankAssignment(4, 6, 4, 6)]


def test_roles_get_their_own_role_ranks() -> None:
    infos = [RoleInfo("ps", 0, 1), RoleInfo("trainer", 1, 3), RoleInfo("ps", 2, 1), RoleInfo("trainer", 3, 3)]
    assert assign(infos) == [
        RankAssignment(0, 8, 0, 2),
        RankAssignment(1, 8, 0, 6),
        RankAssignment(4, 8, 1, 2),
        RankAssignment(5, 8, 3, 6),
    ]


@pytest.mark.anyio
async def test_exchange_through_the_store() -> None:
    results: dict[int, RankAssignment] = {}
    async with open_store_server("127.0.0.1", 0) as server:

        async def node(rank: int, nproc: int) -> None:
            async with open_store_client("127.0.0.1", server.port) as client:
                results[rank] = await exchange_ranks(client.prefixed("round0"), RoleInfo("r", rank, nproc), 3)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for rank, nproc in ((2, 1), (0, 2), (1, 3)):
                    tg.start_soon(node, rank, nproc)
    assert results == {0: RankAssignment(0, 6, 0, 6), 1: RankAssignment(2, 6, 2, 6), 2: RankAssignment(5, 6, 5, 6)}


@pytest.mark.anyio
async def test_identical_workers_fast_path_needs_no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_WORKER_IDENTICAL", "1")

    class NoStore:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the fast path touched the store ({name})")

    identical = workers_identical()  # what the launcher reads and hands the agent
    assert await exchange_ranks(NoStore(), RoleInfo("r", 2, 4), 3, identical=identical) == RankAssignment(  # type: ignore[arg-type]
        8, 12, 8, 12
    )
