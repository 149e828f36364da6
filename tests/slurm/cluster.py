"""A real Slurm cluster on one machine: Debian's slurmctld and slurmd (22.05) in network namespaces.

Theory of operation
-------------------
Like the fault suite's hosts (``tests/faults/conftest.py``), every name carries a random tag so that two clusters
never collide, and the addresses are a private /24 derived from the tag. Unlike it, the bridge lives in a *hub*
namespace, not in the root one: nothing of the cluster is visible from the machine's own network, and the cluster
sends nothing anywhere but inside its namespaces::

    hub namespace  sl-TAG-hub: bridge "br0" (SUBNET.254, hostname "ctl"): slurmctld, and the clients (srun, sbatch)
      |-- veth slTAGv1 <-> eth0 in sl-TAG-node1 (SUBNET.1, hostname "node1"): slurmd
      |-- veth slTAGv2 <-> eth0 in sl-TAG-node2 (SUBNET.2, hostname "node2"): slurmd
      ...

Each daemon and each client command runs as ``nsenter --net=/run/netns/NS unshare --uts --mount --propagation
private sh -c 'mount --bind HOSTS /etc/hosts; hostname NAME; exec "$@"'``: its own network, its own hostname, and a
hosts file that names every node, in a mount namespace of its own (so the bind mount vanishes with its last
process and the machine's ``/etc/hosts`` is never touched). ``ip netns exec`` would remount ``/sys``, after which
slurmd fails ("No filesystem mounted on /sys/fs/cgroup"). The daemons run in the foreground (``-D``) and the shell
``exec``s them, so the pid the fixture holds is the daemon's own.

Authentication is ``auth/none`` (no munge); every state, spool, pid and log file is under the cluster's directory;
``SlurmdParameters=config_overrides`` lets a node declare 1 CPU and ``gpus`` GPUs (a ``gres.conf`` with a count and
no device file) whatever the machine has, so ``--gpus-per-node`` works without a GPU.

Waits: Slurm offers no event to await a node's state or a job's end from outside, so the waits poll ``sinfo`` /
``scontrol`` every 0.1 s up to a generous deadline and fail with the daemons' log tails.

Teardown, also after a failure: SIGTERM each daemon by pid (SIGKILL after 10 s), SIGKILL whatever still runs in
the namespaces (job steps, slurmstepd, clients), wait until it is gone and reaped, delete the namespaces (the
bridge and the veth pairs go with them; the bind mounts went with their mount namespaces). :meth:`SlurmCluster.
teardown` returns what it found left behind, which the fixture asserts is nothing.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from helpers.procs import poll_until

T = TypeVar("T")

DEADLINE = 120.0  # generous: daemons and jobs on a small machine shared with other work
POLL = 0.1
BINARIES = ("slurmctld", "slurmd", "slurmstepd", "srun", "sbatch", "scontrol", "scancel", "sinfo", "squeue")
PACKAGES = ("slurmctld", "slurmd", "slurm-client")
CTL = "ctl"  # the hub's hostname: SlurmctldHost


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False, timeout=30)
    return [int(pid) for pid in out.stdout.split()]


def _init_zombies(comm: str) -> list[int]:
    """Pids of exited ``comm`` processes that init has not reaped yet."""
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError):
            stat_line = stat_file.read_text()
            name, _, rest = stat_line.partition("(")[2].rpartition(")")
            state, ppid = rest.split()[:2]
            if name == comm and state == "Z" and ppid == "1":
                found.append(int(stat_file.parent.name))
    return found


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return "(no file)"


# --- can a cluster be built here ---------------------------------------------------------------------------------


def step_records(folder: Path) -> list[dict[str, Any]]:
    """What the test trainers wrote to ``folder`` (one JSON line per event, per host), in time order; a line still
    being written is left out."""
    lines = [line for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    return sorted((json.loads(line) for line in lines if line.endswith("}")), key=lambda r: r["time"])


def first_steps(folder: Path, hosts: set[str], world: int, after: float) -> dict[str, float] | None:
    """When each of ``hosts`` first completed a step in a world of ``world`` after ``after``, if all have."""
    seen: dict[str, float] = {}
    for r in step_records(folder):
        if r["event"] == "step" and r["world"] == world and r["time"] > after and r["host"] in hosts:
            seen.setdefault(r["host"], r["time"])
    return seen if set(seen) == hosts else None


def step_exit_code(cluster: SlurmCluster, folder: Path, host: str, timeout: float) -> int:
    """The exit status the batch script writes to ``rc.<host>`` when ``host``'s step ends, once the line is complete:
    the shell creates the file before it writes to it, so an empty file is not an answer yet."""

    def line() -> str | None:
        with suppress(FileNotFoundError):
            text = (folder / f"rc.{host}").read_text()
            return text if text.endswith("\n") else None
        return None

    return int(cluster.wait_for(f"{host}'s step to end", line, timeout))


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def ensure_slurm(*, install: bool = True) -> str | None:
    """None if a cluster can be built here, else why not (the reason to skip with).

    Slurm's binaries are looked up first; if any is missing and ``install`` (the fixture passes False when
    ``AELASTIC_SLURM_INSTALL=0``), ``apt-get install -y --no-install-recommends slurmctld slurmd slurm-client`` is
    tried (Debian's packages: about 10 s where the package lists are current), and where that fails, once more
    after ``apt-get update``. Root is needed anyway: namespaces, bind mounts, daemons running as SlurmUser=root.
    """
    if os.geteuid() != 0:
        return "a Slurm cluster in network namespaces needs root"
    for tool in ("ip", "nsenter", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"a Slurm cluster in network namespaces needs {tool} (iproute2, util-linux)"
    if missing_binaries():
        if not install:
            return f"Slurm is not installed ({', '.join(missing_binaries())} missing) and AELASTIC_SLURM_INSTALL=0"
        if shutil.which("apt-get") is None:
            return f"Slurm is not installed ({', '.join(missing_binaries())} missing) and there is no apt-get"
        command = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        attempt = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
        if attempt.returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env, timeout=600, check=False)
            attempt = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
        if attempt.returncode != 0 or missing_binaries():
            detail = (attempt.stderr or attempt.stdout).strip().splitlines()[-1:] or ["?"]
            return f"Debian's Slurm packages ({' '.join(PACKAGES)}) could not be installed: {detail[0]}"
    probe = f"sl-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    return None


# --- the cluster -------------------------------------------------------------------------------------------------


@dataclass
class Node:
    name: str  # NodeName and hostname
    netns: str
    addr: str
    link: str  # the veth end in the hub namespace, on the bridge
    slurmd: subprocess.Popen[bytes] | None = field(default=None, repr=False)


class SlurmCluster:
    """``size`` nodes (``node1``..) and a controller (``ctl``); see the module docstring.

    Run Slurm's commands as a user would with :meth:`run` (or :meth:`srun`, :meth:`sbatch`, :meth:`scontrol`,
    :meth:`scancel`), from the hub (``where=None``) or from a node (``where="node1"`` or a :class:`Node`).
    """

    def __init__(
        self, root: Path, size: int = 2, *, cpus: int = 1, gpus: int = 0, partition: str = "debug",
        slurmd_timeout: int = 10, private_shm: bool = False,
    ) -> None:  # fmt: skip
        if not 1 <= size <= 250:
            raise ValueError(f"size {size}")
        self.tag = secrets.token_hex(3)
        self.root = root
        self.cpus, self.gpus, self.partition_name, self.slurmd_timeout = cpus, gpus, partition, slurmd_timeout
        self.private_shm = private_shm  # each node a /dev/shm of its own (its TMPDIR too), which goes with the node
        subnet = f"10.{int(self.tag[:2], 16) % 250 + 1}.{int(self.tag[2:4], 16)}"
        self.hub = f"sl-{self.tag}-hub"
        self.ctl_addr = f"{subnet}.254"
        self.nodes = [
            Node(f"node{i}", f"sl-{self.tag}-node{i}", f"{subnet}.{i}", f"sl{self.tag}v{i}") for i in range(1, size + 1)
        ]
        self.conf = root / "slurm.conf"
        self.hosts = root / "hosts"
        self.logs = root / "log"
        self.slurmctld: subprocess.Popen[bytes] | None = None
        self._namespaces: list[str] = []
        self.env = {"SLURM_CONF": str(self.conf)}  # what a user of this cluster exports
        self.timings: dict[str, float] = {}  # the fixture's: "up", "down" (seconds)

    def __repr__(self) -> str:
        return f"<SlurmCluster {self.tag} {[n.name for n in self.nodes]} at {self.root}>"

    def node(self, which: str | Node) -> Node:
        if isinstance(which, Node):
            return which
        for node in self.nodes:
            if node.name == which:
                return node
        raise KeyError(which)

    # --- building and starting ---------------------------------------------------------------------------------

    def build(self) -> None:
        """The namespaces, the bridge, the veth pairs and the configuration files."""
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("log", "state", "spool", "run", *(f"spool/{node.name}" for node in self.nodes)):
            (self.root / sub).mkdir(exist_ok=True)
        _ip("netns", "add", self.hub)
        self._namespaces.append(self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{self.ctl_addr}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for node in self.nodes:
            _ip("netns", "add", node.netns)
            self._namespaces.append(node.netns)
            _ip("-n", self.hub, "link", "add", node.link, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            _ip("-n", self.hub, "link", "set", node.link, "master", "br0", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        self.hosts.write_text(
            "127.0.0.1 localhost\n"
            + f"{self.ctl_addr} {CTL}\n"
            + "".join(f"{node.addr} {node.name}\n" for node in self.nodes)
        )
        self.conf.write_text(self.slurm_conf())
        if self.gpus:
            (self.root / "gres.conf").write_text(f"Name=gpu File={self._fake_gpus()}\n")
        (self.root / "plugstack.conf").write_text("")

    def _fake_gpus(self) -> str:
        """``gpus`` device files for gres.conf, as a hostlist-style path: character devices that are /dev/null
        (slurmd wants a File for gres/gpu and checks that it is a device; with ``TaskPlugin=task/none`` nothing opens
        or constrains them). Regular files where mknod is refused: slurmd then logs an error and still counts them."""
        folder = self.root / "dev"
        folder.mkdir(exist_ok=True)
        for i in range(self.gpus):
            path = folder / f"gpu{i}"
            try:
                os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            except OSError:
                path.touch()
        return f"{folder}/gpu[0-{self.gpus - 1}]" if self.gpus > 1 else f"{folder}/gpu0"

    @property
    def nodelist(self) -> str:
        """Every node, as a Slurm hostlist."""
        return f"node[1-{len(self.nodes)}]" if len(self.nodes) > 1 else self.nodes[0].name

    def slurm_conf(self) -> str:
        r = self.root
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        lines = [
            f"ClusterName=ae{self.tag}",
            f"SlurmctldHost={CTL}({self.ctl_addr})",
            "AuthType=auth/none",
            "CredType=cred/none",
            "SlurmUser=root",
            "SlurmdUser=root",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            f"SlurmdTimeout={self.slurmd_timeout}",
            "SlurmctldTimeout=30",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=300",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SlurmdParameters=config_overrides",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            *(["GresTypes=gpu"] if self.gpus else []),
            *(
                f"NodeName={node.name} NodeAddr={node.addr} CPUs={self.cpus} RealMemory=1000{gres} State=UNKNOWN"
                for node in self.nodes
            ),
            f"PartitionName={self.partition_name} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        return "\n".join(lines) + "\n"

    def command(self, argv: Iterable[str | os.PathLike[str]], where: str | Node | None = None) -> list[str]:
        """``argv`` as run on ``where`` (a node, or None: the hub, hostname ``ctl``): its network namespace, its
        hostname, the cluster's hosts file; see the module docstring."""
        netns, hostname = (self.hub, CTL) if where is None else (self.node(where).netns, self.node(where).name)
        script = f'mount --bind {shlex.quote(str(self.hosts))} /etc/hosts && hostname {hostname} && exec "$@"'
        if self.private_shm and where is not None:  # in the mount namespace of the node's command (its slurmd)
            script = f"mount -t tmpfs -o size=1g shm /dev/shm && export TMPDIR=/dev/shm && {script}"
        return [
            "nsenter", f"--net=/run/netns/{netns}", "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", script, "sh", *map(str, argv),
        ]  # fmt: skip

    def _daemon(self, argv: list[str], where: Node | None, log: str) -> subprocess.Popen[bytes]:
        with (self.logs / log).open("ab") as out:
            return subprocess.Popen(
                self.command(argv, where),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # a ^C at the test's terminal reaches pytest, which then tears down
            )

    def start_slurmctld(self) -> None:
        self.slurmctld = self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], None, "slurmctld.out")

    def start_slurmd(self, which: str | Node) -> None:
        """Start (or restart, after :meth:`kill_node`) ``which``'s slurmd."""
        node = self.node(which)
        if node.slurmd is not None and node.slurmd.poll() is None:
            raise RuntimeError(f"{node.name}'s slurmd runs already (pid {node.slurmd.pid})")
        argv = ["slurmd", "-D", "-N", node.name, "-f", str(self.conf)]
        node.slurmd = self._daemon(argv, node, f"slurmd-{node.name}.out")

    def start(self, timeout: float = DEADLINE) -> None:
        """Build, start every daemon, and wait until the controller answers and every node is idle."""
        self.build()
        self.start_slurmctld()
        for node in self.nodes:
            self.start_slurmd(node)

        def answers() -> bool:
            self._alive()
            return "is UP" in self.run("scontrol", "ping", check=False).stdout

        def idle() -> bool:
            self._alive()
            states = self.node_states()
            return len(states) == len(self.nodes) and set(states.values()) == {"idle"}

        self.wait_for("slurmctld to answer", answers, timeout)
        self.wait_for("every node idle", idle, timeout)

    def _alive(self) -> None:
        """Fail at once, with the logs, if a daemon has exited (while starting: a bad configuration, a port taken)."""
        for name, proc in [("slurmctld", self.slurmctld), *((f"{n.name}'s slurmd", n.slurmd) for n in self.nodes)]:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode}\n{self.daemon_logs()}")

    # --- running commands as a user -----------------------------------------------------------------------------

    def run(
        self, *argv: str | os.PathLike[str], where: str | Node | None = None, timeout: float = DEADLINE,
        check: bool = True, env: Mapping[str, str] | None = None, input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run ``argv`` on ``where`` (None: the hub) with this cluster's ``SLURM_CONF``; text output captured.
        ``check``: a non-zero exit raises with both outputs."""
        done = subprocess.run(
            self.command(argv, where),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env, **(env or {})},
            input=input,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{shlex.join(map(str, argv))} on {where or CTL} exited {done.returncode}\n"
                f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
            )
        return done

    def srun(self, *args: str | os.PathLike[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return self.run("srun", *args, **kwargs)  # type: ignore[arg-type]

    def scontrol(self, *args: str | os.PathLike[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return self.run("scontrol", *args, **kwargs)  # type: ignore[arg-type]

    def scancel(self, *args: str | os.PathLike[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return self.run("scancel", *args, **kwargs)  # type: ignore[arg-type]

    def sbatch(
        self, script: str, *args: str | os.PathLike[str], where: str | Node | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:  # fmt: skip
        """Submit ``script`` (its text; a ``#!`` line is added if missing) with ``sbatch --parsable ARGS``; the job
        id. The job's working directory is the cluster's ``jobs/`` directory unless ``args`` say otherwise."""
        if not script.startswith("#!"):
            script = "#!/bin/sh\n" + script
        jobs = self.root / "jobs"
        jobs.mkdir(exist_ok=True)
        done = self.run("sbatch", "--parsable", f"--chdir={jobs}", *args, where=where, env=env, input=script)
        return done.stdout.strip().split(";")[0]

    # --- what Slurm says ----------------------------------------------------------------------------------------

    def hostnames(self, hostlist: str) -> list[str]:
        """``scontrol show hostnames HOSTLIST``: the reference expansion."""
        return self.scontrol("show", "hostnames", hostlist).stdout.split()

    def node_states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` prints it (lower case, e.g. ``idle``, ``alloc``, ``down*``)."""
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def wait_nodes(
        self, states: Collection[str], nodes: Iterable[str | Node] | None = None, timeout: float = DEADLINE
    ) -> dict[str, str]:
        """Wait until each of ``nodes`` (default: all) is in one of ``states`` (``sinfo``'s words, e.g. ``idle``,
        ``down``, ``down*``; a trailing ``*`` means not responding)."""
        names = {self.node(n).name for n in (self.nodes if nodes is None else nodes)}

        def check() -> dict[str, str] | None:
            now = self.node_states()
            return now if all(now.get(name) in states for name in names) else None

        return self.wait_for(f"{sorted(names)} in {sorted(states)}", check, timeout)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o JOB`` as a dict (``JobState``, ``NodeList``, ``Restarts``, ``ExitCode``...)."""
        out = self.scontrol("show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", out))

    def wait_job(
        self, job_id: str, states: Collection[str] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"),
        timeout: float = DEADLINE,
    ) -> dict[str, str]:  # fmt: skip
        """Wait until ``job_id``'s ``JobState`` is one of ``states`` (default: any end); the job's record."""

        def check() -> dict[str, str] | None:
            record = self.job(job_id)
            return record if record.get("JobState") in states else None

        return self.wait_for(f"job {job_id} in {sorted(states)}", check, timeout)

    def wait_for(self, what: str, check: Callable[[], T | None], timeout: float = DEADLINE) -> T:
        """Poll ``check`` every 0.1 s until it returns something truthy; on timeout fail with the daemons' logs."""
        return poll_until(what, check, timeout, POLL, self.daemon_logs)

    def daemon_logs(self, chars: int = 2000) -> str:
        return "\n".join(f"--- {path.name}:\n{_tail(path, chars)}" for path in sorted(self.logs.glob("*")))

    # --- faults ---------------------------------------------------------------------------------------------------

    def kill_node(self, which: str | Node, *, silent: bool = False) -> None:
        """SIGKILL everything on ``which``: its slurmd and every job process there. ``silent``: its link goes down
        first (a power loss: nothing more reaches anyone); else its kernel lives on and refuses connections.
        :meth:`heal` and :meth:`start_slurmd` bring it back."""
        node = self.node(which)
        if silent:
            self.partition(node)
        for pid in _netns_pids(node.netns):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if node.slurmd is not None:
            with suppress(subprocess.TimeoutExpired):
                node.slurmd.wait(30)

    def partition(self, which: str | Node) -> None:
        """Cut ``which`` off the network, both ways; its processes and sockets stay."""
        _ip("-n", self.hub, "link", "set", self.node(which).link, "down")

    def heal(self, which: str | Node) -> None:
        _ip("-n", self.hub, "link", "set", self.node(which).link, "up")

    def revive(self, which: str | Node, timeout: float = DEADLINE) -> None:
        """Undo :meth:`kill_node` or :meth:`partition`: the link up, slurmd started if it is not running, and the
        node back to ``idle`` (``ReturnToService=2`` returns a DOWN node when its slurmd registers again)."""
        node = self.node(which)
        self.heal(node)
        if node.slurmd is None or node.slurmd.poll() is not None:
            self.start_slurmd(node)
        self.wait_nodes({"idle"}, [node], timeout)

    # --- teardown ----------------------------------------------------------------------------------------------

    def teardown(self) -> list[str]:
        """Stop everything (see the module docstring); what was left behind (empty when all went)."""
        daemons = [p for p in [self.slurmctld, *(n.slurmd for n in self.nodes)] if p is not None]
        for proc in daemons:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in daemons:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in daemons:  # still there after 10 s: SIGKILL
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    proc.kill()
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(30)
        left: list[str] = []
        # Then whatever else runs in the namespaces (slurmstepd, job processes, clients): SIGKILL, until none is
        # left, and until each is reaped (a killed slurmstepd is a zombie of init's for a moment: ``ip netns pids``
        # no longer lists it, /proc still does).
        killed: set[int] = set()
        deadline = time.monotonic() + 30
        while True:
            running = {pid: netns for netns in self._namespaces for pid in _netns_pids(netns)}
            reaping = {pid for pid in killed if os.path.exists(f"/proc/{pid}")}
            if not running and not reaping:
                break
            if time.monotonic() > deadline:
                left += [f"pid {pid} in {netns}" for pid, netns in running.items()]
                left += [f"pid {pid} not reaped" for pid in reaping - set(running)]
                break
            for pid in running:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed |= set(running)
            time.sleep(0.05)  # killed processes are reaped by init: no event to await from here
        for netns in self._namespaces:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        # Each step's slurmstepd, double-forked by slurmd, ends as a zombie of init's: dead, holding nothing, gone
        # when init reaps it (within about 1 s here). Wait for that (pgrep slurm is then empty) but never fail on it.
        deadline = time.monotonic() + 10
        while _init_zombies("slurmstepd") and time.monotonic() < deadline:
            time.sleep(0.05)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        left += [f"namespace {line.split()[0]}" for line in listed.splitlines() if f"sl-{self.tag}-" in line]
        left += [f"daemon pid {p.pid} running" for p in daemons if p.poll() is None]
        self._namespaces.clear()
        return left


@contextmanager
def slurm_cluster(root: Path, size: int = 2, **kwargs: int | str) -> Iterator[SlurmCluster]:
    """A started cluster of ``size`` nodes under ``root``, torn down on exit (also on failure); raises if the
    teardown left anything behind. Check :func:`ensure_slurm` first."""
    cluster = SlurmCluster(root, size, **kwargs)  # type: ignore[arg-type]
    left: list[str] = []
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.teardown()
    if left:
        raise AssertionError(f"{cluster!r}: teardown left {left}")
