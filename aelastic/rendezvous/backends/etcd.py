"""The ``etcd`` rendezvous backend: the dynamic rendezvous over etcd's v3 API (txn, leases, watches).

Keys, under ``<key_prefix>/<run_id>/``:

``state``
    ``b"<version> <joined>\\n<encoded state>"`` (``joined``: the join requests the writes up to this version
    consumed). The version is the integer the handler sees; the fencing token is the key's ``mod_revision`` and
    the revision of the read: a write is a txn that puts only if ``mod_revision`` is still the one read (0 for a
    key never written) and no join request is newer than the read, puts the digest beside it, deletes the join
    requests (the writer folded them), and whose failure branch reads the winner's state back.
``digest`` and ``pos/<shard>``
    the state's digest (``codec.make_digest``), written in the same txn as the state: ``b"<version> <joined>
    <shards>\\n<summary>"`` and the position shards, each headed by ``<version>\\n`` (the shards past the count
    are deleted). A node that only waits reads the summary and its own shard, O(1) bytes, not the whole state.
``joins/<random>``
    one pending join request each (see ``RendezvousBackend.request_join``), read with the state at one revision
    and ordered by create revision. The txn that puts one counts, at its revision, the requests consumed (the
    digest's ``joined``) and those pending: its ticket, from which the node tells without a read whether its
    request is the one that completes the round or brings it to ``min_nodes``.
``alive/<node_key>``
    attached to the node's own lease (TTL = the liveness grace); each beat renews the lease. A node that stops
    beating loses the key when etcd expires its lease: the server is the only clock, no other node writes.
``store/...``
    the members' :class:`~aelastic.etcd.EtcdStore` (each round's store is cut from it).

Waiting for a change: a node's handler follows ``digest`` with one watch (every wait awaits its word, which
carries the digest, so a woken node reads only its shard); outside a handler (``aelastic status``), a watch from
the revision after the read.

``--rdzv-endpoint embedded[:HOST,...]`` is the job's own etcd (:mod:`aelastic.etcd.embedded`): the first hosts run
its members beside their agents, and every node's rendezvous uses it with member failover. The ``--rdzv-conf``
keys of both kinds, and their defaults, are :mod:`.etcd_conf`'s.

torch's ``etcd-v2`` backend name is accepted as an alias (it spoke etcd's v2 API, gone since etcd 3.6).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Final

import anyio
import anyio.abc

from ...errors import (
    ConfigurationError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdError,
    EtcdLeaseExpiredError,
    EtcdRequestError,
    RendezvousConnectionError,
    RendezvousStateError,
)
from ...etcd.client import EtcdClient, open_etcd_client
from ...etcd.embedded import JobEtcdSettings, open_job_etcd
from ...etcd.layout import Layout
from ...etcd.messages import (
    Compare,
    CompareResult,
    CompareTarget,
    DeleteOp,
    EventType,
    PutOp,
    RangeOp,
    RangeResponse,
    SortOrder,
    SortTarget,
    prefix_range_end,
)
from ...etcd.store import EtcdStore
from ..api import JoinObserver, RendezvousHandler, RendezvousParameters
from ..codec import Digest, shard_of
from ..dynamic import open_dynamic_rendezvous
from ..settings import HandlerOptions
from ..values import NodeDesc
from .base import DigestRead, RendezvousBackend, StateReader, Versioned
from .etcd_conf import etcd_setup

__all__ = [
    "EtcdBackend",
    "open_etcd_reader",
    "open_etcd_rendezvous",
    "open_etcd_v2_rendezvous",
]

logger = logging.getLogger(__name__)

_UNAVAILABLE: Final = 14  # gRPC status of "no leader" / "leader changed"
_FOLLOW_RETRY, _FOLLOW_RETRY_MAX = 0.1, 2.0  # pauses between attempts to follow the digest when no member answers
_OUT_OF_RANGE: Final = 11  # gRPC status of a read at a revision compacted away
_MAX_SHARDS: Final = 120  # position shards written with the state: its txn must stay within etcd's 128 operations

_local_ids = iter(range(1 << 62))


@dataclass(frozen=True, slots=True)
class _Token:
    """What a write compares against: the state's ``mod_revision`` and the store revision of the read."""

    mod_revision: int
    read_revision: int


@dataclass(frozen=True, slots=True)
class _Digest:
    """The ``digest`` key as of one revision: the version it describes, the join requests consumed up to it, how
    many position shards it has, and the summary."""

    version: int
    joined: int
    shards: int
    summary: bytes
    revision: int  # the store revision at which it was read (or written), where its shards are read

    @classmethod
    def parse(cls, raw: bytes, revision: int) -> _Digest:
        head, sep, summary = raw.partition(b"\n")
        fields = head.split(b" ")
        if not sep or len(fields) != 3 or not all(f.isdigit() for f in fields):
            raise RendezvousStateError(
                f"etcd rendezvous digest holds {raw[:40]!r}: not '<version> <joined> <shards>\\n<summary>' "
                "(are all nodes running the same aelastic version?)"
            )
        version, joined, shards = map(int, fields)
        return cls(version, joined, shards, summary, revision)


class _Follower:
    """The newest digest that the task following the ``digest`` key (:meth:`EtcdBackend.following`) has seen;
    waiters are woken at each news."""

    def __init__(self) -> None:
        self.latest: _Digest | None = None
        self._news = anyio.Event()

    def __repr__(self) -> str:
        return f"<_Follower latest={self.latest and self.latest.version}>"

    def tell(self, digest: _Digest) -> None:
        if self.latest is None or digest.version > self.latest.version or digest.revision > self.latest.revision:
            self.latest = digest
            self._news.set()
            self._news = anyio.Event()

    async def wait_past(self, version: int) -> None:
        """Return once a digest newer than ``version`` was seen."""
        while self.latest is None or self.latest.version <= version:
            await self._news.wait()


class EtcdBackend(RendezvousBackend):
    """The rendezvous driver over etcd for one run id; see the module docstring.

    ``lease_ttl`` is the liveness grace in whole seconds (etcd's lease unit, at least etcd's minimum of ~2 s).
    """

    digests = True

    def __init__(self, client: EtcdClient, key_prefix: str, run_id: str, *, lease_ttl: int, name: str = "etcd"):
        if lease_ttl < 1:
            raise ConfigurationError(f"etcd lease TTL {lease_ttl}: must be >= 1 s")
        self.name = name
        self.client = client
        self.root = f"{key_prefix.rstrip('/')}/{run_id}"
        self.store = EtcdStore(client, f"{self.root}/store")
        self.lease_ttl = lease_ttl
        self._state_key = f"{self.root}/state".encode()
        self._digest_key = f"{self.root}/digest".encode()
        self._positions = f"{self.root}/pos/".encode()
        self._joins = f"{self.root}/joins/".encode()
        self._read_ops = [
            RangeOp(self._state_key),
            RangeOp(self._joins, prefix_range_end(self._joins), sort_target=SortTarget.CREATE,
                    sort_order=SortOrder.ASCEND),
        ]  # fmt: skip
        # What a join request's txn reads back to count it: the digest (how many requests were consumed) and how
        # many are pending (this one included).
        self._ticket_ops = [RangeOp(self._digest_key), RangeOp(self._joins, prefix_range_end(self._joins),
                                                               count_only=True)]  # fmt: skip
        self._leases: dict[str, int] = {}
        self._follower: _Follower | None = None  # the task following the digest key, while following() lasts

    @property
    def location(self) -> str:  # type: ignore[override]  # the members may change (a job's own etcd heals)
        return f"etcd at {','.join(self.client.config.endpoints)}"

    def __repr__(self) -> str:
        return f"<EtcdBackend {self.name} {self.root!r} leases={len(self._leases)} {self.client!r}>"

    def _alive_key(self, node_key: str) -> bytes:
        return f"{self.root}/alive/{node_key}".encode()

    def _position_key(self, shard: int) -> bytes:
        return self._positions + b"%06d" % shard  # zero-padded: the shards past a count are one key range

    def _versioned(self, read_revision: int, state: RangeResponse, joins: RangeResponse) -> Versioned:
        """The state and its pending join requests from the two ranges of ``self._read_ops``."""
        pending = tuple(kv.value for kv in joins.kvs)
        if not state.kvs:
            return Versioned(0, None, _Token(0, read_revision), pending)
        kv = state.kvs[0]
        head, sep, body = kv.value.partition(b"\n")
        version, _, joined = head.partition(b" ")
        if not sep or not version.isdigit() or not joined.isdigit():
            raise RendezvousStateError(
                f"etcd key {self._state_key.decode()!r} holds {kv.value[:40]!r}: not '<version> <joined>\\n<state>' "
                "(are all nodes running the same aelastic version?)"
            )
        return Versioned(int(version), body, _Token(kv.mod_revision, read_revision), pending, int(joined))

    async def get_state(self) -> Versioned:
        """The state and the join requests pending on it, read at one revision."""
        state, joins = await self.client.read(self._read_ops)
        return self._versioned(state.revision, state, joins)

    async def set_state(self, data: bytes, expected: Versioned, digest: Digest) -> tuple[Versioned, bool]:
        """A txn: if the state is unchanged and no join request is newer than the read, write the state, its
        digest and position shards, and delete the requests (the writer folded them); else read both back."""
        token = expected.token
        if not isinstance(token, _Token):
            raise RendezvousStateError(f"{expected!r} was not read from this backend")
        version, joined = expected.version + 1, expected.joined + len(expected.pending)
        # etcd refuses a txn of more than --max-txn-ops operations (128 by default): past that many shards (some
        # 7,700 nodes) no shard is written, and the nodes read the whole state.
        shards = digest.shards if len(digest.shards) <= _MAX_SHARDS else ()
        key, joins, joins_end = self._state_key, self._joins, prefix_range_end(self._joins)
        unchanged = [
            Compare.mod_revision(key, token.mod_revision),
            Compare(joins, CompareTarget.MOD, token.read_revision + 1, CompareResult.LESS, joins_end),
        ]
        writes: list[PutOp | DeleteOp] = [
            PutOp(key, b"%d %d\n%b" % (version, joined, data)),
            PutOp(self._digest_key, b"%d %d %d\n%b" % (version, joined, len(shards), digest.summary)),
            *(PutOp(self._position_key(i), b"%d\n%b" % (version, shard)) for i, shard in enumerate(shards)),
            DeleteOp(self._position_key(len(shards)), prefix_range_end(self._positions)),
            DeleteOp(joins, joins_end),
        ]
        try:
            response = await self.client.txn(unchanged, writes, self._read_ops)
        except (EtcdConnectionError, EtcdRequestError) as exc:
            if isinstance(exc, EtcdRequestError) and exc.code != _UNAVAILABLE:
                raise
            # The member went away (or lost its leader) with the txn in flight: it may or may not have applied.
            # The state says which; a version past ours holding our bytes is our write (or one identical to it).
            logger.warning("etcd rendezvous %s: %s; reading the state back", self.root, exc)
            current = await self.get_state()
            return current, (current.version, current.data) == (version, data)
        if response.succeeded:
            return Versioned(version, data, _Token(response.revision, response.revision), (), joined), True
        return self._versioned(response.revision, response.range(0), response.range(1)), False

    def _ticket(self, digest: RangeResponse, pending: RangeResponse) -> int:
        """How many join requests were appended by the revision of these two reads: those the digest says were
        consumed, and those still pending."""
        joined = _Digest.parse(digest.kvs[0].value, digest.revision).joined if digest.kvs else 0
        return joined + pending.count

    async def request_join(self, request: bytes) -> int:
        """A key of its own under ``joins/`` (the create revision orders the requests), put in a txn that counts
        the requests appended up to it: its ticket."""
        key = self._joins + secrets.token_hex(8).encode()
        try:
            response = await self.client.txn([], [PutOp(key, request), *self._ticket_ops])
        except EtcdConnectionError as exc:
            logger.warning("etcd rendezvous %s: %s; putting the join request again", self.root, exc)
            return await self._join_again(key, request)
        return self._ticket(response.range(1), response.range(2))

    async def _join_again(self, key: bytes, request: bytes) -> int:
        """A join request whose txn's outcome is unknown: put it unless it is there, and count it where it was
        put (the counts at its create revision)."""
        absent = [Compare(key, CompareTarget.CREATE, 0)]
        response = await self.client.txn(absent, [PutOp(key, request), *self._ticket_ops], [RangeOp(key)])
        if response.succeeded:
            return self._ticket(response.range(1), response.range(2))
        put = response.range(0).kvs[0].create_revision
        digest, pending = await self.client.read([replace(op, revision=put) for op in self._ticket_ops])
        return self._ticket(digest, pending)

    async def _read_digest(self) -> _Digest:
        """The digest now; version 0 (no shard) while no state was written."""
        kv, revision = await self.client.get(self._digest_key)
        return _Digest(0, 0, 0, b"", revision) if kv is None else _Digest.parse(kv.value, revision)

    async def read_digest(self, node_key: str, known: int) -> DigestRead | None:
        """The digest, and the node's shard as of the digest's revision (one read). The digest is the one the
        follower last saw when a change woke the node (``known``: the version it announced), else one read: with
        no version known (``known`` -1) the node looks without news, and the follower may be the one stuck (its
        member silent, the watch waiting on it), so its word is no answer then."""
        follower = self._follower
        digest = follower.latest if follower is not None and known >= 0 else None
        if digest is None or digest.version < known:
            digest = await self._read_digest()
        if digest.version == 0:
            return DigestRead(0, 0, None, None)
        if digest.shards == 0:
            return None  # too many nodes for the shards to be written with the state: read it whole
        try:
            shard = await self.client.range(
                RangeOp(self._position_key(shard_of(node_key, digest.shards)), revision=digest.revision)
            )
        except EtcdRequestError as exc:
            if exc.code != _OUT_OF_RANGE:
                raise
            return None  # that revision was compacted away: read the state
        head, _, positions = shard.kvs[0].value.partition(b"\n") if shard.kvs else (b"", b"", b"")
        if head != b"%d" % digest.version:
            return None
        return DigestRead(digest.version, digest.joined, digest.summary, positions)

    async def wait_for_change(self, seen: Versioned) -> None:
        """Returns once a version after ``seen``'s was written. Join requests are other keys: they wake no one.

        Inside :meth:`following` the follower's word is awaited (no request); else a watch of the digest key from
        the revision after the read, for this wait alone (watching from the read's revision, not an older
        ``mod_revision``, starts at the head of history, where etcd delivers events at once).
        """
        if self._follower is not None:
            await self._follower.wait_past(seen.version)
            return
        if not isinstance(seen.token, _Token):
            await anyio.lowlevel.checkpoint()
            return
        try:
            async with self.client.watch(self._digest_key, start_revision=seen.token.read_revision + 1) as events:
                async for event in events:
                    if event.type is EventType.PUT:
                        return
        except EtcdCompactedError:
            return  # the history since the read is gone: the caller reads

    @asynccontextmanager
    async def following(self) -> AsyncIterator[None]:
        """Follow the digest key in a task of its own while this lasts: every wait for a change then awaits its
        word, so a round's completion wakes N waiting nodes with the digest it wrote and no request (not N watches
        opened, closed and read again). Returns once the watch is registered and the digest read; raises what
        opening it raises."""
        follower = _Follower()
        async with anyio.create_task_group() as tg:
            await tg.start(self._follow, follower)
            self._follower = follower
            try:
                yield
            finally:
                self._follower = None
                tg.cancel_scope.cancel()

    async def _follow(
        self, follower: _Follower, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Tell ``follower`` each digest written from now on. The watch reopens on the next member by itself; when
        none answers, it is opened again from where it stopped (from now, reading the digest, if that history is
        gone) until the caller stops it: the liveness judges a lost etcd."""
        pause, start, started = _FOLLOW_RETRY, 0, False
        while True:
            try:
                async with self.client.watch(self._digest_key, start_revision=start) as events:
                    if start == 0:  # from now: what was written before the watch began is read
                        follower.tell(await self._read_digest())
                    if not started:
                        started = True
                        task_status.started()
                    pause = _FOLLOW_RETRY
                    async for event in events:
                        if event.type is EventType.PUT:
                            follower.tell(_Digest.parse(event.kv.value, event.kv.mod_revision))
                        start = events.next_revision
            except EtcdCompactedError:
                start = 0
                continue
            except EtcdError as exc:
                if not started:
                    raise  # never started: the caller's error
                logger.warning("etcd rendezvous %s: following the digest: %s; again in %.1f s", self.root, exc, pause)
            await anyio.sleep(pause)
            pause = min(2 * pause, _FOLLOW_RETRY_MAX)

    async def keep_alive(self, node_key: str) -> None:
        """Renew ``node_key``'s lease; on the first beat (or after it expired) grant one and attach ``alive/``."""
        lease = self._leases.get(node_key)
        if lease is not None:
            try:
                await self.client.lease_keep_alive(lease)
            except EtcdLeaseExpiredError:
                logger.warning("etcd rendezvous %s: the lease of %s expired; granting a new one", self.root, node_key)
                del self._leases[node_key]
            else:
                return
        granted = await self.client.lease_grant(self.lease_ttl)
        self._leases[node_key] = granted.id
        await self.client.put(self._alive_key(node_key), b"", lease=granted.id)

    async def find_dead(self, node_keys: Sequence[str], grace: float) -> frozenset[str]:
        """The nodes whose ``alive/`` key is gone: etcd expired their lease (``grace`` is the lease TTL here)."""
        if not node_keys:
            return frozenset()
        response = await self.client.txn([], [RangeOp(self._alive_key(k), count_only=True) for k in node_keys])
        return frozenset(k for i, k in enumerate(node_keys) if response.range(i).count == 0)

    async def release(self) -> None:
        """Revoke this process's leases, so its ``alive/`` keys go now rather than at expiry. Shielded, bounded."""
        with anyio.move_on_after(2.0, shield=True):
            for node_key, lease in list(self._leases.items()):
                try:
                    await self.client.lease_revoke(lease)
                except EtcdError as exc:
                    logger.debug("etcd rendezvous %s: revoking the lease of %s: %r", self.root, node_key, exc)
                del self._leases[node_key]


@asynccontextmanager
async def open_etcd_rendezvous(
    params: RendezvousParameters, *, observer: JoinObserver | None = None
) -> AsyncIterator[RendezvousHandler]:
    """The dynamic rendezvous over the etcd cluster at ``params.endpoint`` (``h1:2379,h2:2379``).

    Connecting (and the first round trip) must finish within ``read_timeout`` (60 s), else
    :class:`~aelastic.errors.RendezvousConnectionError` names the endpoints. On exit the node's lease is revoked.
    """
    timing, settings = etcd_setup(params)
    rendezvous = timing.rendezvous
    lease_ttl = max(1, math.ceil(rendezvous.keep_alive_interval * rendezvous.keep_alive_max_attempt))
    async with AsyncExitStack() as stack:
        if settings.embedded is not None:
            client = await _join_job_etcd(
                stack, settings.embedded, params, rendezvous.join_timeout, lease_ttl, settings.etcd.password
            )
        try:
            with anyio.fail_after(settings.read_timeout):
                if settings.embedded is None:
                    client = await stack.enter_async_context(open_etcd_client(settings.etcd))
                addr = params.local_addr or await client.local_address()
        except (EtcdConnectionError, TimeoutError) as exc:
            raise RendezvousConnectionError(
                f"could not reach etcd at {','.join(settings.etcd.endpoints)} within "
                f"read_timeout={settings.read_timeout:g}s: {exc}"
            ) from exc
        backend = EtcdBackend(client, settings.key_prefix, params.run_id, lease_ttl=lease_ttl)
        await stack.enter_async_context(backend.following())
        stack.push_async_callback(backend.release)
        node = NodeDesc(addr, os.getpid(), next(_local_ids))
        options = HandlerOptions(
            params.backend, addr, timing.heartbeat_timeout, settings.read_timeout, observer=observer,
            share_store=params.share_store,
        )  # fmt: skip
        async with open_dynamic_rendezvous(node, rendezvous, backend, options) as handler:
            yield handler


async def _join_job_etcd(
    stack: AsyncExitStack,
    layout: Layout,
    params: RendezvousParameters,
    start_timeout: float,
    lease_ttl: int,
    password: str | None,
) -> EtcdClient:
    """This node's part in the job's own etcd, for the stack's length: the client that follows its members."""
    settings = JobEtcdSettings(layout, lease_ttl, start_timeout, local_addr=params.local_addr, root_password=password)
    try:
        job = await stack.enter_async_context(open_job_etcd(settings, params.run_id))
    except (TimeoutError, EtcdError) as exc:
        raise RendezvousConnectionError(
            f"the job's etcd (first members on {', '.join(layout.initial)}, etcd_port {layout.client_port}) did "
            f"not answer with a leader within join_timeout={start_timeout:g}s: "
            f"{exc or 'fewer than a quorum of its first members started'}"
        ) from exc
    return job.client


@asynccontextmanager
async def open_etcd_v2_rendezvous(
    params: RendezvousParameters, *, observer: JoinObserver | None = None
) -> AsyncIterator[RendezvousHandler]:
    """torch's ``etcd-v2`` name: the same backend (aelastic speaks etcd's v3 API only)."""
    logger.info("rendezvous backend 'etcd-v2': aelastic speaks etcd's v3 API (etcd >= 3.4); using the 'etcd' backend")
    async with open_etcd_rendezvous(params, observer=observer) as handler:
        yield handler


@asynccontextmanager
async def open_etcd_reader(params: RendezvousParameters) -> AsyncIterator[StateReader]:
    """A reader of the run's state in etcd (``aelastic status``): it grants no lease and writes nothing."""
    _, settings = etcd_setup(params)
    async with open_etcd_client(settings.etcd) as client:
        # lease_ttl is never used: this reader grants no lease and writes nothing.
        yield EtcdBackend(client, settings.key_prefix, params.run_id, lease_ttl=1)
