"""The shim of this folder: a master TCPStore becomes torch's client of an ``aelastic store`` process, which stops
with its scope, and nothing outside ``patched()`` sees it."""

from __future__ import annotations

import datetime
import importlib.util
import inspect
import re
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("torch")
import torch.distributed as dist

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def shim() -> ModuleType:
    module = sys.modules.get("aelastic_store_shim")
    if module is None:
        path = Path(__file__).with_name("aelastic_store_shim.py")
        spec = importlib.util.spec_from_file_location("aelastic_store_shim", path)
        assert spec is not None
        assert spec.loader is not None
        module = sys.modules["aelastic_store_shim"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


@pytest.fixture
def scope(shim: ModuleType) -> Iterator[ModuleType]:
    mark = shim.SERVERS.mark()
    try:
        with shim.patched():
            yield shim
    finally:
        shim.SERVERS.stop_from(mark)


def test_master_is_a_client_of_an_aelastic_store(scope: ModuleType) -> None:
    mark = scope.SERVERS.mark()
    store = dist.TCPStore("localhost", 0, 1, True, timeout=timedelta(seconds=30))
    (server,) = scope.SERVERS.running[mark:]
    assert type(store) is scope.TORCH_TCPSTORE
    assert isinstance(store, dist.TCPStore)
    assert store.port == server.port != 0
    assert "server=<nullptr>" in repr(store)  # no torch server in this process
    store.set("key", "value")
    assert store.get("key") == b"value"
    assert store.num_keys() == 2  # "key" and torch's init/ (the client counted itself in)

    process = server.process
    scope.SERVERS.stop_from(mark)
    assert process.poll() == 0  # SIGTERM: the command exits 0, and it is reaped


def test_multi_tenant_shares_the_server_and_bind_errors_are_torchs(scope: ModuleType) -> None:
    first = dist.TCPStore("localhost", 0, 1, True, multi_tenant=True)
    mark = scope.SERVERS.mark()
    second = dist.TCPStore("localhost", first.port, 1, True, multi_tenant=True)
    assert scope.SERVERS.mark() == mark  # the same aelastic store
    first.set("shared", "1")
    assert second.get("shared") == b"1"

    with pytest.raises(dist.DistNetworkError, match=re.escape(f"[::]:{first.port}: Address already in use")):
        dist.TCPStore("localhost", first.port, 1, True)
    assert scope.SERVERS.mark() == mark


def test_patched_restores_every_name(shim: ModuleType) -> None:
    import torch._C._distributed_c10d as c10d

    with shim.patched():
        assert dist.TCPStore is shim.ServedTCPStore
        assert c10d.TCPStore is shim.ServedTCPStore
        assert sys.modules["torch.distributed.rendezvous"].TCPStore is shim.ServedTCPStore
    modules = list(sys.modules.values())
    assert not [m for m in modules if getattr(m, "TCPStore", None) is shim.ServedTCPStore]
    assert dist.TCPStore is shim.TORCH_TCPSTORE


def test_signature_is_torchs(shim: ModuleType) -> None:
    """``construct`` takes torch's parameters, in torch's order, with torch's defaults (its binding's docstring)."""
    doc = shim.TORCH_TCPSTORE.__init__.__doc__.splitlines()[0]  # __init__(self: ..., host_name: str, ...) -> None
    inner = doc[doc.index("(") + 1 : doc.rindex(") ->")]
    torch_params = [piece.partition(": ") for piece in re.split(r", (?=\w+: )", inner)][1:]  # less self
    ours = inspect.signature(shim.construct).parameters
    assert [name for name, _, _ in torch_params] == list(ours)
    for name, _, annotated in torch_params:
        _, equals, default = annotated.partition(" = ")
        expected = eval(default, {"datetime": datetime}) if equals else inspect.Parameter.empty
        assert ours[name].default == expected, name
