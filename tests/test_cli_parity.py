"""``aelastic run`` against the real ``torchrun`` (torch 2.13): the same flags give workers the same environment and
argv, and so do the same flags given as ``PET_<FLAG>`` variables.

Each case runs ``tests/cli_probe.py`` (it writes its argv and environment to ``$PROBE_OUT/rank<RANK>.json``) under
``torchrun``, under ``aelastic run`` with the same flags, and under ``aelastic run`` with the flags given as
``PET_*`` variables instead. Every variable a launcher set or changed is compared; values that must differ per run
are compared by form:

* ``MASTER_PORT``: a port number (each run's workers' store listens on a fresh kernel-chosen port);
* ``TORCHELASTIC_RUN_ID`` under ``--standalone``: a random UUID4;
* ``TORCHELASTIC_ERROR_FILE``: ``<tmp>/torchelastic_*/<run id>_*/attempt_<n>/<local rank>/error.json``;
* ``MASTER_ADDR``: an address of this machine. torch advertises ``socket.getfqdn()``; aelastic advertises the
  local address of its connection to the rendezvous store (routable by construction, never a reverse lookup:
  pytorch#73656, #150532), so the two may spell this machine differently.

``AELASTIC_*`` variables are aelastic's own additions (``AELASTIC_MEMBERSHIP_RESTARTS``); every other variable,
and argv, must be equal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers.procs import free_port

from aelastic._net import is_local_host

pytestmark = pytest.mark.torch

torch_distributed = pytest.importorskip("torch.distributed")

TESTS = Path(__file__).parent
PROBE = str(TESTS / "cli_probe.py")
TORCHRUN = shutil.which("torchrun")
AELASTIC = [sys.executable, "-m", "aelastic", "run"]
DEADLINE = 180.0  # seconds for one launch on a loaded machine; a hang fails the test instead of blocking it
# Arguments pass through unchanged, except torch's ${local_rank} macro (string.Template: "$$" is an escaped "$").
ARGS = ["--alpha", "1", "two words", "rank=${local_rank}", "$$HOME"]
SWITCHES = {"--standalone": "STANDALONE", "-m": "MODULE", "--no-python": "NO_PYTHON"}  # store_true flags

Flags = list[list[str]]  # one command line (flags only) per node


def as_pet(flags: Sequence[str]) -> dict[str, str]:
    """The same flags as PET_<FLAG> variables (torch's ``env`` and ``check_env`` actions)."""
    env: dict[str, str] = {}
    items = list(flags)
    while items:
        flag = items.pop(0)
        if flag in SWITCHES:
            env[f"PET_{SWITCHES[flag]}"] = "1"
        else:
            env["PET_" + flag.lstrip("-").replace("-", "_").upper()] = items.pop(0)
    return env


@contextmanager
def launched(argv: Sequence[str], env: Mapping[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A launcher in its own session; whatever happens, its whole process group is gone afterwards."""
    process = subprocess.Popen(
        list(argv), env=dict(env), cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


def finish(process: subprocess.Popen[bytes]) -> None:
    out, _ = process.communicate(timeout=DEADLINE)
    assert process.returncode == 0, f"{process.args} exited {process.returncode}:\n{out.decode(errors='replace')}"


def normalized(record: Mapping[str, Any], parent: Mapping[str, str]) -> dict[str, Any]:
    """What the launcher gave one worker: argv, and every variable it set or changed, per-run values by form."""
    env: dict[str, str] = record["env"]
    given = {k: v for k, v in env.items() if parent.get(k) != v and not k.startswith(("AELASTIC_", "PET_"))}
    run_id = given["TORCHELASTIC_RUN_ID"]
    port = given["MASTER_PORT"]
    assert re.fullmatch(r"[1-9]\d{0,4}", port), f"MASTER_PORT={port!r}"
    assert int(port) < 65536, f"MASTER_PORT={port!r}"
    given["MASTER_PORT"] = "<port>"
    assert is_local_host(given["MASTER_ADDR"]), f"MASTER_ADDR={given['MASTER_ADDR']!r} does not name this machine"
    given["MASTER_ADDR"] = "<this machine>"
    pattern = rf".*/torchelastic_[^/]+/{re.escape(run_id)}_[^/]+/attempt_(\d+)/(\d+)/error\.json"
    match = re.fullmatch(pattern, given["TORCHELASTIC_ERROR_FILE"])
    assert match, f"TORCHELASTIC_ERROR_FILE={given['TORCHELASTIC_ERROR_FILE']!r} is not {pattern}"
    given["TORCHELASTIC_ERROR_FILE"] = f"<log dir>/attempt_{match[1]}/{match[2]}/error.json"
    if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", run_id):
        assert str(uuid.UUID(run_id)) == run_id
        given["TORCHELASTIC_RUN_ID"] = "<uuid4>"
    return {"argv": record["argv"], "env": dict(sorted(given.items()))}


def run(
    launcher: Sequence[str], nodes: Flags, tail: Sequence[str], out: Path, *, pet: bool, world_size: int
) -> dict[int, Any]:
    """Start one launcher per node (flags on the command line, or as PET_* variables), wait for all of them,
    and return each rank's normalized record."""
    out.mkdir()
    parent = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "OMP_NUM_THREADS"))}
    parent["PROBE_OUT"] = str(out)
    envs = [parent | as_pet(flags) if pet else parent for flags in nodes]
    with ExitStack() as stack:
        processes = [
            stack.enter_context(launched([*launcher, *([] if pet else flags), *tail], env))
            for flags, env in zip(nodes, envs, strict=True)
        ]
        for process in processes:
            finish(process)
    found = {int(p.stem[len("rank") :]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(found) == list(range(world_size)), f"probe files of ranks {sorted(found)}"
    return {rank: normalized(record, parent) for rank, record in found.items()}


@pytest.fixture
def c10d_store() -> Iterator[Callable[[], int]]:
    """Fresh rendezvous stores (torch's own TCPStore on a kernel-chosen port) for the two-node c10d case: each
    launcher run gets its own. Every agent finds the port taken and connects as a client, as torch's does."""
    from torch.distributed import TCPStore

    stores: list[Any] = []

    def new() -> int:
        stores.append(TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False))
        return int(stores[-1].port)

    yield new
    stores.clear()


def no_python_wrapper(tmp_path: Path) -> str:
    """An executable (not a Python file) for --no-python: a shell script that runs the probe."""
    wrapper = tmp_path / "probe.sh"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{PROBE}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def case(name: str, tmp_path: Path, c10d_store: Callable[[], int]) -> tuple[Callable[[], Flags], list[str]]:
    """A case's command line: a function giving each node's flags (called once per launcher run, for fresh ports)
    and the script with its arguments."""
    if name == "standalone":
        return lambda: [["--standalone", "--nproc-per-node", "2"]], [PROBE, *ARGS]
    if name == "c10d-two-nodes":

        def c10d() -> Flags:
            endpoint = f"127.0.0.1:{c10d_store()}"
            node = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", "parity"]  # fmt: skip
            return [node, node]

        return c10d, [PROBE, *ARGS]
    if name == "static-two-nodes":

        def static() -> Flags:
            port = str(free_port())
            return [["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                     "--master-port", port] for rank in (0, 1)]  # fmt: skip

        return static, [PROBE, *ARGS]
    if name == "module":
        return lambda: [["--standalone", "--nproc-per-node", "2", "-m"]], ["cli_probe", *ARGS]
    assert name == "no-python"
    return lambda: [["--standalone", "--nproc-per-node", "1", "--no-python"]], [no_python_wrapper(tmp_path), *ARGS]


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")
@pytest.mark.parametrize("name", ["standalone", "c10d-two-nodes", "static-two-nodes", "module", "no-python"])
def test_same_worker_environment_and_argv_as_torchrun(name: str, tmp_path: Path, c10d_store: Callable[[], int]) -> None:
    flags, tail = case(name, tmp_path, c10d_store)
    world_size = {"c10d-two-nodes": 4, "static-two-nodes": 2, "no-python": 1}.get(name, 2)
    torch_view = run([str(TORCHRUN)], flags(), tail, tmp_path / "torchrun", pet=False, world_size=world_size)
    ours = run(AELASTIC, flags(), tail, tmp_path / "aelastic", pet=False, world_size=world_size)
    assert ours == torch_view
    from_env = run(AELASTIC, flags(), tail, tmp_path / "aelastic-pet", pet=True, world_size=world_size)
    assert from_env == torch_view


UNSHARED_STORE_WORKER = """
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")  # env://: rank 0's worker serves the store unless the agent's is used
value = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(value)
dist.destroy_process_group()
record = {"use_agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"], "sum": value.item()}
with open(os.path.join(os.environ["PROBE_OUT"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)
"""


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")
def test_unshared_rendezvous_store_gives_workers_what_torchrun_gives(tmp_path: Path) -> None:
    """``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torchrun's workers see ``TORCHELASTIC_USE_AGENT_STORE=False``
    and rank 0's worker serves the workers' store itself; the same job runs under aelastic, seeing the same."""
    script = tmp_path / "unshared.py"
    script.write_text(UNSHARED_STORE_WORKER)
    parent = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    parent |= {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    seen = {}
    for name, launcher in (("torchrun", [str(TORCHRUN)]), ("aelastic", AELASTIC)):
        out = tmp_path / name
        out.mkdir()
        with launched(
            [*launcher, "--standalone", "--nproc-per-node", "2", str(script)], parent | {"PROBE_OUT": str(out)}
        ) as p:
            finish(p)
        seen[name] = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}
    expected = {"use_agent_store": "False", "sum": 3.0}
    assert seen["torchrun"] == {"rank0.json": expected, "rank1.json": expected}
    assert seen["aelastic"] == seen["torchrun"]
