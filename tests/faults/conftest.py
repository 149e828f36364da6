"""Hosts on one machine: network namespaces joined by veth pairs on a private bridge, one aelastic agent each.

Theory of operation
-------------------
The ``cluster`` fixture builds a bridge and 3–4 network namespaces with names unique to the test (a random tag, so
parallel runs never collide), each holding one end of a veth pair (``eth0``, an address in a private /24); the
other end is plugged into the bridge in the root namespace. The bridge carries no address, so nothing on the real
machine can reach the hosts or be reached by them. A partition is ``ip link set <root end> down``: the host keeps
its processes and its sockets, and its packets go nowhere until the link is back up. A slow link is a token bucket
(``tc qdisc ... tbf``) on both ends of a host's veth; it goes with the veth when the namespace is deleted.

Every process of a host runs under ``ip netns exec`` (the same pid, the namespace's network only) and, for clock
skew, under ``unshare --time`` with CLOCK_MONOTONIC and CLOCK_BOOTTIME offsets. Agents are real ``aelastic run``
processes with ``--local-addr`` and ``--log-dir``; workers are :mod:`tests.faults.trainer` (gloo all-reduce steps)
reporting progress in files under the host's directory, which the tests wait on (a file appearing has no event to
await: the waits are bounded polls with a generous deadline). Each namespace is fresh, so the fixed well-known
ports inside it (29400 for the c10d store, 2379/2380 for etcd) cannot be taken by anyone else.

Teardown, also after a failure: SIGKILL every process in every namespace (``ip netns pids``), wait until they are
gone, delete the namespaces and the bridge.

Each scenario reports the time it measured with :func:`report_time`: printed, and appended to
``benchmarks/out/faults.json`` in the benchmark format so that RESULTS.md can cite it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from helpers import results
from helpers.procs import poll_until

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).resolve().parent / "trainer.py"
PROBE = Path(__file__).resolve().parent / "probe.py"
DEADLINE = 120.0  # generous: several agents and torch workers on a small, shared machine
C10D_PORT = 29400
STEP_PAUSE = 0.05  # the trainer's pause after each all-reduce step

# Liveness used by the scenarios: a node whose heartbeat has not moved for 3 x 0.5 s is dead.
KEEP_ALIVE_INTERVAL, KEEP_ALIVE_MAX_ATTEMPT, HEARTBEAT_TIMEOUT = 0.5, 3, 2.0
GRACE = KEEP_ALIVE_INTERVAL * KEEP_ALIVE_MAX_ATTEMPT
FAST_CONF = (
    f"keep_alive_interval={KEEP_ALIVE_INTERVAL},keep_alive_max_attempt={KEEP_ALIVE_MAX_ATTEMPT},"
    f"heartbeat_timeout={HEARTBEAT_TIMEOUT},last_call_timeout=1"
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def report_time(
    scenario: str, seconds: float | None, what: str, *, system: str = "aelastic", outcome: str | None = None
) -> None:
    """A fault scenario's time (or outcome) for RESULTS.md: see :func:`helpers.results.report_time`."""
    results.report_time("faults", scenario, seconds, what, system=system, outcome=outcome)


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    addr: str
    link: str  # the veth end in the root namespace, on the bridge
    dir: Path

    def command(self, *argv: str | os.PathLike[str], time_offset: int = 0, private_shm: bool = False) -> list[str]:
        """``argv`` run in this host's network namespace (and with its clocks ``time_offset`` seconds ahead).
        ``private_shm``: with a ``/dev/shm`` of its own (``ip netns exec`` gives each command a mount namespace of
        its own; a tmpfs mounted there goes with the command's last process), and its temporary directory there
        (``TMPDIR``: a job etcd member's data), as a separate machine has: what a host keeps there vanishes with
        the host."""
        prefix = ["ip", "netns", "exec", self.netns]
        if private_shm:
            prefix += ["sh", "-c", 'mount -t tmpfs -o size=1g shm /dev/shm && TMPDIR=/dev/shm exec "$@"', "sh"]
        if time_offset:
            prefix += ["unshare", "--time", "--monotonic", str(time_offset), "--boottime", str(time_offset)]
        return [*prefix, *map(str, argv)]


class Proc:
    """A process in a host's namespace; stdout and stderr go to a file."""

    def __init__(self, host: Host, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.host = host
        self.popen = popen
        self.log = log

    def __repr__(self) -> str:
        return f"<Proc {self.host.name} pid={self.popen.pid} rc={self.popen.poll()} {self.log.name}>"

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def logged_at(self, pattern: str) -> float | None:
        """The wall-clock time of the first log line matching ``pattern`` (the CLI's log format), else None."""
        for match in re.finditer(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\] (.*)$", self.output, re.M):
            if re.search(pattern, match[3]):
                stamp = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S")
                return stamp.timestamp() + int(match[2]) / 1000
        return None

    def running(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.popen.pid, sig)

    def wait(self, timeout: float = DEADLINE) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self!r} still running after {timeout:g} s:\n{self.output[-3000:]}") from None


class Cluster:
    """The hosts of one test and the processes it started on them; see the module docstring."""

    def __init__(self, tmp_path: Path, size: int) -> None:
        self.tag = secrets.token_hex(3)
        self.bridge = f"aeb{self.tag}"
        self.out = tmp_path / "out"
        self.out.mkdir()
        subnet = f"10.{int(self.tag[:2], 16) % 250 + 1}.{int(self.tag[2:4], 16)}"
        self.hosts = [
            Host(f"h{i}", f"ae-{self.tag}-h{i}", f"{subnet}.{i + 1}", f"aev{self.tag}{i}", self.out / f"h{i}")
            for i in range(size)
        ]
        self.procs: list[Proc] = []
        self._namespaces: list[str] = []

    # --- the network ---------------------------------------------------------------------------------------------

    def build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        # Every host's name resolves inside every namespace, as a cluster's DNS would answer: `ip netns exec`
        # mounts /etc/netns/<name>/hosts over /etc/hosts. Without it torch's TCPStore client looks its peer's
        # address up in this machine's unreachable DNS and waits out the resolver's timeout (5 s and more).
        names = "".join(f"{h.addr} {h.name}\n" for h in self.hosts)
        for host in self.hosts:
            host.dir.mkdir()
            _ip("netns", "add", host.netns)
            self._namespaces.append(host.netns)
            etc = Path("/etc/netns") / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost ip6-localhost\n{names}")
            _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("link", "set", host.link, "master", self.bridge, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")

    def throttle(self, host: Host, rate: str) -> None:
        """Limit ``host``'s link to ``rate`` (``tc`` units: ``100mbit``) both ways, with a token bucket on each end
        of its veth (this kernel has no netem: a rate is what can be set, and it is exact whatever the CPUs do)."""
        bucket = ["tbf", "rate", rate, "burst", "64kb", "latency", "50ms"]
        subprocess.run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", "eth0", "root", *bucket],
                       check=True, capture_output=True, text=True, timeout=30)  # fmt: skip
        subprocess.run(["tc", "qdisc", "add", "dev", host.link, "root", *bucket], check=True, capture_output=True,
                       text=True, timeout=30)  # fmt: skip

    def partition(self, host: Host) -> None:
        """Cut ``host`` off the network, both ways; its processes and sockets stay."""
        _ip("link", "set", host.link, "down")

    def heal(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def kill_host(self, host: Host, *, silent: bool) -> None:
        """Every process on ``host`` is SIGKILLed. ``silent``: its link goes down first, as in a power loss (no
        FIN, no RST reaches anyone, peers' packets vanish); else its kernel lives on and refuses connections."""
        if silent:
            self.partition(host)
        self._kill_all(host.netns)

    def _kill_all(self, netns: str) -> None:
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False)
        for pid in map(int, pids.stdout.split()):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def teardown(self) -> None:
        for netns in self._namespaces:
            self._kill_all(netns)
        for proc in self.procs:
            with suppress(subprocess.TimeoutExpired):
                proc.popen.wait(30)
        for netns in self._namespaces:
            deadline = time.monotonic() + 30
            while subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.strip():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # SIGKILLed workers of SIGKILLed agents: reaped by init, no event here
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    # --- processes -----------------------------------------------------------------------------------------------

    def spawn(
        self, host: Host, *argv: str | os.PathLike[str], log: str, env: dict[str, str] | None = None,
        time_offset: int = 0, private_shm: bool = False,
    ) -> Proc:  # fmt: skip
        path = host.dir / f"{log}.log"
        with path.open("ab") as f:
            popen = subprocess.Popen(
                host.command(*argv, time_offset=time_offset, private_shm=private_shm),
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        proc = Proc(host, popen, path)
        self.procs.append(proc)
        return proc

    def agent(
        self, host: Host, *, nnodes: str, rdzv: Sequence[str], backend: str = "asyncio", max_restarts: int = 0,
        env: dict[str, str] | None = None, time_offset: int = 0, log: str = "agent", log_level: str = "INFO",
        launcher: str = "aelastic", flags: Sequence[str] = (), private_shm: bool = False,
    ) -> Proc:  # fmt: skip
        """``aelastic run`` (or, with ``launcher="torchrun"``, torch's own launcher with the same torchrun flags)
        of the trainer on ``host``: one worker, this host's address, logs under its dir; ``flags`` go before the
        script; ``private_shm``: see :meth:`Host.command`."""
        if launcher == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run"]
            env = {"LOGLEVEL": log_level, **(env or {})}
        else:
            command = [sys.executable, "-m", "aelastic", "--async-backend", backend, "--log-level", log_level, "run"]
        return self.spawn(
            host,
            *command,
            "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", str(max_restarts),
            "--shutdown-timeout", "2", "--local-addr", host.addr, "--log-dir", host.dir / "logs", *rdzv, *flags,
            TRAINER, self.out,
            log=log,
            # gloo picks its interface from the hostname, which names the real machine: use the host's eth0.
            env={"FAULTS_HOST": host.name, "FAULTS_STEP_PAUSE": str(STEP_PAUSE), "GLOO_SOCKET_IFNAME": "eth0",
                 "OMP_NUM_THREADS": "1", **(env or {})},
            time_offset=time_offset, private_shm=private_shm,
        )  # fmt: skip

    def store_host_dies(self, *, silent: bool, store_lost: float, verdict: float) -> tuple[list[Proc], float]:
        """Every host trains on c10d (``--nnodes 2:<hosts>``), the store served by h0's agent; h0 dies (its
        processes crash, or ``silent``: it loses power). Returns the survivors' agents, each awaited to its
        failing exit, and the seconds from the death to the last exit. ``store_lost``: their ``read_timeout``."""
        rdzv = self.c10d(f"{FAST_CONF},read_timeout={store_lost:g}")
        agents = [self.agent(h, nnodes=f"2:{len(self.hosts)}", rdzv=rdzv, max_restarts=3) for h in self.hosts]
        self.wait_training(self.hosts, len(self.hosts))
        died = time.time()
        self.kill_host(self.hosts[0], silent=silent)
        for agent in agents[1:]:
            assert agent.wait(timeout=verdict + store_lost) != 0, agent.output
        return agents[1:], time.time() - died

    def c10d(self, conf: str = FAST_CONF, run_id: str = "faults") -> list[str]:
        """Rendezvous flags for c10d with the store served by h0's agent."""
        endpoint = f"{self.hosts[0].addr}:{C10D_PORT}"
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", conf]

    # --- what the workers report ---------------------------------------------------------------------------------

    def records(self, event: str = "progress") -> list[dict[str, Any]]:
        found = []
        for path in self.out.glob(f"h*/{event}-*.json"):
            with suppress(FileNotFoundError):  # replaced between glob and read: the next poll sees it
                found.append(json.loads(path.read_text()))
        return found

    def wait_for(self, what: str, check: Callable[[], T | None], timeout: float = DEADLINE) -> T:
        """Poll ``check`` until it returns something truthy; on timeout fail with every process's log tail."""
        return poll_until(what, check, timeout, 0.02, self.logs)

    def wait_training(
        self, hosts: Sequence[Host], world: int, *, old: Sequence[dict[str, Any]] = (), steps: int = 3,
        timeout: float = DEADLINE,
    ) -> dict[str, dict[str, Any]]:  # fmt: skip
        """Wait until a worker on each of ``hosts`` has done ``steps`` all-reduce steps in a world of ``world``;
        workers that wrote one of the ``old`` records do not count. Returns the latest records by host."""
        names = {h.name for h in hosts}
        old_pids = {r["pid"] for r in old}

        def check() -> dict[str, dict[str, Any]] | None:
            found = {
                r["host"]: r
                for r in self.records()
                if r["host"] in names and r["world_size"] == world and r["step"] >= steps and r["pid"] not in old_pids
            }
            return found if set(found) == names else None

        return self.wait_for(f"training in a world of {world} on {sorted(names)}", check, timeout)

    def logs(self) -> str:
        return "\n".join(f"--- {p.host.name} {p.log.name} ({p!r}):\n{p.output[-3000:]}" for p in self.procs)


def _namespaces_permitted() -> str | None:
    """None if this process may build network namespaces, else why not."""
    if os.geteuid() != 0:
        return "the fault suite builds network namespaces: it needs root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "the fault suite needs iproute2 (ip) and util-linux (unshare)"
    probe = f"ae-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    return None


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """Three hosts (or as many as an indirect parameter says); skipped where network namespaces are not permitted."""
    pytest.importorskip("torch")
    why = _namespaces_permitted()
    if why is not None:
        pytest.skip(why)
    cluster = Cluster(tmp_path, getattr(request, "param", 3))
    try:
        cluster.build()
        yield cluster
    finally:
        cluster.teardown()
