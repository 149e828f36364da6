"""The optional shared token: a store with one refuses clients without it (ours with a one-line error naming the
rule, torch's by closing), never stores it, and the workers' store of a token-protected c10d rendezvous still
serves torch's own workers, which cannot carry a token."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta

import anyio
import pytest
import torch.distributed as dist
from helpers.store import (
    GLOO_WORKER,
    anyio_backend,  # noqa: F401 (the fixture: these tests run on uvloop too)
    wait_for_connections,
)
from helpers.torch_store_peer import PeerError, TorchPeer

from aelastic.errors import ConfigurationError, RendezvousConnectionError, StoreAuthError
from aelastic.rendezvous.api import RendezvousParameters
from aelastic.rendezvous.registry import open_rendezvous
from aelastic.store import auth
from aelastic.store.api import PrefixStore
from aelastic.store.client import StoreClient, open_store_client
from aelastic.store.server import ServerSettings, StoreServer, open_store_server

pytestmark = pytest.mark.anyio

TOKEN = "correct horse battery staple"


@pytest.fixture
async def server() -> AsyncIterator[StoreServer]:
    async with open_store_server("127.0.0.1", 0, ServerSettings(auth_token=TOKEN, handshake_timeout=5)) as server:
        yield server


async def test_client_with_the_token_is_served(server: StoreServer) -> None:
    with anyio.fail_after(10):
        async with open_store_client("127.0.0.1", server.port, auth_token=TOKEN) as client:
            await client.set("k", b"v")
            assert await client.get("k") == b"v"  # a GET: its WAIT first, on the same authenticated connection
            assert await client.list_keys() == ["k"]
            assert await client.num_keys() == 1  # the token is checked, never stored


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (None, r"requires an auth token and this client has none: set --rdzv-conf auth_token=\.\.\. "),
        ("wrong", r"refused this client's auth token: every node must use the same --rdzv-conf auth_token"),
    ],
)
async def test_client_without_or_with_a_wrong_token_is_refused_at_once(
    token: str | None, message: str, server: StoreServer
) -> None:
    with anyio.fail_after(60):  # a deadline that a retry loop would spend before failing
        started = anyio.current_time()
        with pytest.raises(StoreAuthError, match=message) as info:
            async with open_store_client("127.0.0.1", server.port, auth_token=token):
                pass
        assert anyio.current_time() - started < 5  # refused at once, not retried
    text = str(info.value)
    assert "\n" not in text
    assert f"127.0.0.1:{server.port}" in text
    assert "AELASTIC_AUTH_TOKEN" in text
    await wait_for_connections(server, 0)


@pytest.mark.torch
async def test_torch_client_is_refused_while_ours_works(server: StoreServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aelastic.store")
    peer = TorchPeer()
    try:
        async with open_store_client("127.0.0.1", server.port, auth_token=TOKEN) as client:
            with pytest.raises(PeerError):
                await peer.connect("127.0.0.1", server.port, client_timeout_s=2)
            await client.set("still", b"served")
            assert await client.get("still") == b"served"
            await wait_for_connections(server, 1)  # ours (its waits share it); torch's is gone
        assert "Ping where the auth token was due: this store requires one" in caplog.text
    finally:
        peer.close()


@pytest.fixture
def torch_server() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server
    del server


async def test_token_client_works_with_a_server_that_checks_none(torch_server: dist.TCPStore) -> None:
    """torch's server (and ours without a token) answer the token CHECK NOT_READY and serve on; nothing is stored."""
    async with open_store_client("127.0.0.1", torch_server.port, auth_token=TOKEN) as client:
        await client.set("k", b"v")
        assert await client.get("k") == b"v"
    assert torch_server.list_keys() == ["k"]  # the CHECK wrote nothing


def test_token_comes_from_the_conf_key_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.AUTH_TOKEN_ENV, raising=False)
    assert auth.resolve_auth_token(None) is None
    monkeypatch.setenv(auth.AUTH_TOKEN_ENV, "from-env")
    assert auth.resolve_auth_token(None) == "from-env"
    assert auth.resolve_auth_token("from-conf") == "from-conf"
    with pytest.raises(ConfigurationError, match=r"--rdzv-conf auth_token: a token of 0 bytes; it must be 1..1024"):
        auth.resolve_auth_token("")


# --- the c10d backend ---------------------------------------------------------------------------------------------


@pytest.mark.torch
async def test_c10d_token_refuses_strangers_and_torch_workers_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.AUTH_TOKEN_ENV, TOKEN)  # the hosting node takes its token from the environment
    params = RendezvousParameters("c10d", "127.0.0.1:0", "auth-test", 1, 1, join_timeout=30, last_call_timeout=0.1)
    with anyio.fail_after(120):
        async with open_rendezvous(params) as handler:
            info = await handler.next_rendezvous()
            assert isinstance(info.store, PrefixStore)
            assert isinstance(info.store.store, StoreClient)
            rendezvous_port = info.store.store.port
            monkeypatch.delenv(auth.AUTH_TOKEN_ENV)

            # A stranger (no token) and a node with the wrong token are refused by the rendezvous store.
            with pytest.raises(StoreAuthError, match="requires an auth token"):
                async with open_store_client("127.0.0.1", rendezvous_port):
                    pass
            wrong = RendezvousParameters(
                "c10d", f"127.0.0.1:{rendezvous_port}", "auth-test", 1, 2, auth_token="wrong", is_host=False
            )
            with pytest.raises(RendezvousConnectionError, match="refused this client's auth token") as refused:
                async with open_rendezvous(wrong):
                    pass
            assert "\n" not in str(refused.value)

            # torch's workers use the round's workers' store, which takes no token.
            bootstrap = info.bootstrap_store_info
            await run_gloo_workers(bootstrap.master_addr, bootstrap.master_port, world=2)
            await handler.shutdown()


async def run_gloo_workers(addr: str, port: int, world: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_", "TORCHELASTIC"))}
    env.update(MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    outputs: dict[int, str] = {}

    async def worker(rank: int) -> None:
        result = await anyio.run_process(
            [sys.executable, "-c", GLOO_WORKER], env={**env, "RANK": str(rank)}, check=False
        )
        assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
        outputs[rank] = result.stdout.decode().strip()

    async with anyio.create_task_group() as tg:
        for rank in range(world):
            tg.start_soon(worker, rank)
    total = world * (world + 1) // 2
    assert outputs == {rank: f"rank={rank} sum={total}" for rank in range(world)}
