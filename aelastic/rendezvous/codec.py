"""The rendezvous state's bytes: the encoded state, join requests, and the digests a waiting node reads.

Every format is JSON with a version field (:data:`FORMAT_VERSION`), decoded strictly: a reader rejects another
version, a missing or unknown field, a value of the wrong type or one that breaks an invariant of the state, with
an error that says which. Nothing here is pickled, and nothing holds a clock.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Final, NamedTuple

from ..errors import ConfigurationError, RendezvousStateError
from .joins import JoinRequest
from .state import regrouped, survivors
from .values import NodeDesc, RendezvousState, StateView, check_endpoint, is_int

__all__ = [
    "FORMAT_VERSION",
    "SHARD_SIZE",
    "Digest",
    "decode_join_request",
    "decode_state",
    "decode_view",
    "encode_join_request",
    "encode_state",
    "make_digest",
    "shard_of",
]

FORMAT_VERSION: Final = 4
"""The ``"v"`` field of the encoded state, of its digest and of join requests; a reader rejects any other value.
v2 added the digest (:func:`make_digest`): a reader of v1 state would not publish one, so the two must not share a
run. v3 added each node's bootstrap endpoint (``endpoints``, the ``"master"`` of the summary): a v2 node would
wait for a rank 0 that no longer publishes its address in the round's store. v4 added the members found dead
(``lost``) and the fast quorum's facts in the summary (``regrouped``, ``survivors``): a v3 node would wait out the
last call that a v4 node skips, and mark nothing lost."""


# --- encoding -----------------------------------------------------------------------------------------------------
# {"v":4,"round":3,"complete":true,"closed":false,"nodes":[["10.0.0.1",4242,0],...],
#  "endpoints":["10.0.0.1:40123",null,...],"participants":[0,1],"wait_list":[2],"redundancy_list":[],
#  "rank_order":[0,1,3],"lost":[3]}
# Each node appears once in "nodes" (sorted); "endpoints" pairs with it; the lists hold indices into it.

_LISTS: Final = ("participants", "wait_list", "redundancy_list", "rank_order", "lost")
_KEYS: Final = frozenset({"v", "round", "complete", "closed", "nodes", "endpoints", *_LISTS})


def encode_state(state: RendezvousState) -> bytes:
    """The state as compact, canonical JSON (UTF-8); see the format above."""
    table = sorted(set(state.all_nodes()) | set(state.rank_order))
    index = {n: i for i, n in enumerate(table)}
    doc: dict[str, object] = {
        "v": FORMAT_VERSION,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "nodes": [[n.addr, n.pid, n.local_id] for n in table],
        "endpoints": [state.endpoints.get(n) for n in table],
    }
    for name in _LISTS:
        doc[name] = [index[n] for n in getattr(state, name)]
    return json.dumps(doc, separators=(",", ":")).encode()


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        keys = [k for k, _ in pairs]
        raise RendezvousStateError(f"rendezvous state has key {next(k for k in keys if keys.count(k) > 1)!r} twice")
    return doc


def _no_constant(name: str) -> object:
    raise RendezvousStateError(f"rendezvous state holds {name}: not a JSON value")


def decode_state(data: bytes) -> RendezvousState:
    """The state that :func:`encode_state` encoded as ``data``.

    Raises:
        RendezvousStateError: ``data`` is not the v4 JSON format (not UTF-8 JSON, another version, a missing,
            unknown or ill-typed field, an index out of range) or breaks a state invariant; the message says which.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RendezvousStateError(f"rendezvous state is a {type(data).__name__}, not bytes")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RendezvousStateError(f"rendezvous state is not UTF-8 JSON ({exc.reason}): {bytes(data)[:40]!r}") from exc
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise RendezvousStateError(f"rendezvous state is not JSON ({exc}): {text[:40]!r}") from exc
    if not isinstance(doc, dict):
        raise RendezvousStateError(f"rendezvous state is a JSON {type(doc).__name__}, not an object: {text[:40]!r}")
    version = doc.get("v")
    if version != FORMAT_VERSION or not is_int(version):
        raise RendezvousStateError(
            f"rendezvous state format v={version!r} is not v={FORMAT_VERSION}, the one this aelastic reads "
            "(are all nodes running the same aelastic version?)"
        )
    if doc.keys() != _KEYS:
        missing, unknown = sorted(_KEYS - doc.keys()), sorted(doc.keys() - _KEYS)
        raise RendezvousStateError(f"rendezvous state v{FORMAT_VERSION} fields: missing {missing}, unknown {unknown}")
    rnd = doc["round"]
    if not is_int(rnd) or rnd < 0:
        raise RendezvousStateError(f"rendezvous state round={rnd!r}: must be an integer >= 0")
    for name in ("complete", "closed"):
        if not isinstance(doc[name], bool):
            raise RendezvousStateError(f"rendezvous state {name}={doc[name]!r}: must be true or false")
    table = _decode_nodes(doc["nodes"])
    endpoints = doc["endpoints"]
    if not isinstance(endpoints, list) or len(endpoints) != len(table):
        raise RendezvousStateError(f"rendezvous state endpoints: must be a list as long as nodes ({len(table)})")
    lists: dict[str, tuple[NodeDesc, ...]] = {}
    used: set[int] = set()
    for name in _LISTS:
        indices = doc[name]
        if not isinstance(indices, list) or not all(is_int(i) and 0 <= i < len(table) for i in indices):
            raise RendezvousStateError(
                f"rendezvous state {name}={indices!r}: must be a list of indices into the {len(table)} nodes"
            )
        if len(set(indices)) != len(indices):
            raise RendezvousStateError(f"rendezvous state {name}={indices!r}: lists a node twice")
        used.update(indices)
        lists[name] = tuple(table[i] for i in indices)
    if len(used) != len(table):
        raise RendezvousStateError(f"rendezvous state nodes {sorted(set(range(len(table))) - used)} are on no list")
    known = {
        node: check_endpoint(endpoint, f"rendezvous state endpoints[{i}]", RendezvousStateError)
        for i, (node, endpoint) in enumerate(zip(table, endpoints, strict=True))
        if endpoint is not None
    }
    return RendezvousState(round=rnd, complete=doc["complete"], closed=doc["closed"], endpoints=known, **lists)


def _decode_nodes(raw: object) -> list[NodeDesc]:
    if not isinstance(raw, list):
        raise RendezvousStateError(f"rendezvous state nodes={raw!r}: must be a list of [addr, pid, local_id]")
    table: list[NodeDesc] = []
    for i, entry in enumerate(raw):
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and is_int(entry[1])
            and is_int(entry[2])
        ):
            raise RendezvousStateError(f"rendezvous state nodes[{i}]={entry!r}: must be [addr, pid, local_id]")
        try:
            table.append(NodeDesc(entry[0], entry[1], entry[2]))
        except ConfigurationError as exc:
            raise RendezvousStateError(f"rendezvous state nodes[{i}]={entry!r}: {exc}") from exc
    if len(set(table)) != len(table):
        raise RendezvousStateError("rendezvous state nodes: a node is listed twice")
    return table


def encode_join_request(request: JoinRequest) -> bytes:
    """A join request as compact JSON: ``[3,"addr",pid,local_id,max_nodes,"host:port" or null]`` (no newline)."""
    node = request.node
    doc = [FORMAT_VERSION, node.addr, node.pid, node.local_id, request.max_nodes, request.endpoint]
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_join_request(data: bytes) -> JoinRequest:
    """The request :func:`encode_join_request` encoded as ``data``.

    Raises:
        RendezvousStateError: ``data`` is not a v4 request; the message shows it.
    """
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RendezvousStateError(f"rendezvous join request is not JSON: {bytes(data)[:60]!r}") from exc
    version = doc[0] if isinstance(doc, list) and doc and is_int(doc[0]) else None
    if isinstance(doc, list) and version != FORMAT_VERSION:
        raise RendezvousStateError(
            f"rendezvous join request {bytes(data)[:60]!r}: format v={version!r} is not v={FORMAT_VERSION}, the one "
            "this aelastic reads (are all nodes running the same aelastic version?)"
        )
    if not (
        isinstance(doc, list)
        and len(doc) == 6
        and isinstance(doc[1], str)
        and all(map(is_int, doc[2:5]))
        and (doc[5] is None or isinstance(doc[5], str))
    ):
        raise RendezvousStateError(
            f"rendezvous join request {bytes(data)[:60]!r}: not [{FORMAT_VERSION}, addr, pid, local_id, max_nodes, "
            "endpoint]"
        )
    try:
        return JoinRequest(NodeDesc(doc[1], doc[2], doc[3]), doc[4], doc[5])
    except ConfigurationError as exc:
        raise RendezvousStateError(f"rendezvous join request {bytes(data)[:60]!r}: {exc}") from exc


# --- digests: what a node reads instead of the whole state -----------------------------------------------------------
# Every node re-reading a state that lists every node costs O(N) bytes per node per change, O(N^2) per round. So
# each write also publishes a digest of the state it wrote: a summary of O(1) bytes (the round, its flags and the
# size of each list) and each node's position (its list, its rank, its liveness neighbour) in shards of at most
# SHARD_SIZE nodes, the node's shard chosen by a hash of its key. A node that only waits reads the summary and its
# shard, O(1) bytes, and decides on a StateView; a node about to write reads the whole state and decides again on it.
# "summary": {"v":4,"round":3,"complete":true,"closed":false,"participants":2,"wait_list":1,"redundancy_list":0,
#             "world_size":3,"shards":1,"master":"10.0.0.1:40123","regrouped":false,"survivors":0}
#             (master: rank 0's endpoint, or null; regrouped and survivors: state.regrouped and state.survivors)
# a shard:   one line per node: "<key> <p|w|r> <rank or -> <neighbour key or ->"

SHARD_SIZE: Final = 64
_WHERE: Final = {"p": "participants", "w": "wait_list", "r": "redundancy_list"}
_SUMMARY_KEYS: Final = frozenset({
    "v", "round", "complete", "closed", "participants", "wait_list", "redundancy_list", "world_size", "shards",
    "master", "regrouped", "survivors",
})  # fmt: skip


def shard_of(key: str, shards: int) -> int:
    """The shard that holds the position of the node whose :attr:`NodeDesc.key` is ``key``."""
    return zlib.crc32(key.encode()) % shards


class Digest(NamedTuple):
    """What a write publishes beside the state: the summary and the position shards (see above)."""

    summary: bytes
    shards: tuple[bytes, ...]


def make_digest(state: RendezvousState) -> Digest:
    """The digest of ``state``: O(1) bytes of summary and O(N) bytes of positions in ``ceil(N / SHARD_SIZE)`` shards.

    A node's liveness neighbour is the node before it in :class:`NodeDesc` order (the first watches the last), as
    the handler's liveness has it; ``-`` when the node is alone.
    """
    listed = state.all_nodes()
    count = max(1, -(-len(listed) // SHARD_SIZE))
    order = sorted(listed)
    before = {n: order[i - 1] for i, n in enumerate(order)} if len(order) > 1 else {}
    rank = {n: i for i, n in enumerate(state.rank_order)} if state.complete else {}
    lines: list[list[str]] = [[] for _ in range(count)]
    for code, name in _WHERE.items():
        for node in getattr(state, name):
            r = rank.get(node) if code == "p" else None
            n = before.get(node)
            lines[shard_of(node.key, count)].append(
                f"{node.key} {code} {'-' if r is None else r} {'-' if n is None else n.key}"
            )
    doc = {
        "v": FORMAT_VERSION,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "participants": len(state.participants),
        "wait_list": len(state.wait_list),
        "redundancy_list": len(state.redundancy_list),
        "world_size": state.world_size,
        "shards": count,
        "master": state.master,
        "regrouped": regrouped(state),
        "survivors": survivors(state),
    }
    summary = json.dumps(doc, separators=(",", ":")).encode()
    return Digest(summary, tuple("\n".join(ls).encode() for ls in lines))


def decode_view(node: NodeDesc, summary: bytes, shard: bytes | None) -> tuple[StateView, int]:
    """``node``'s view of a state from the digest's summary and the shard that holds ``node`` (``None`` when the
    state lists no node); also the number of shards, to find the shard of a later version.

    Raises:
        RendezvousStateError: the summary or the shard is not the v4 format; the message says which.
    """
    try:
        doc = json.loads(summary)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RendezvousStateError(f"rendezvous digest is not JSON: {bytes(summary)[:60]!r}") from exc
    version = doc.get("v") if isinstance(doc, dict) else None
    if version != FORMAT_VERSION or not is_int(version):
        raise RendezvousStateError(
            f"rendezvous digest format v={version!r} is not v={FORMAT_VERSION}, the one this aelastic reads "
            "(are all nodes running the same aelastic version?)"
        )
    ints = ("round", "participants", "wait_list", "redundancy_list", "world_size", "shards", "survivors")
    if (
        doc.keys() != _SUMMARY_KEYS
        or not all(is_int(doc[k]) and doc[k] >= 0 for k in ints)
        or not isinstance(doc["regrouped"], bool)
    ):
        raise RendezvousStateError(f"rendezvous digest {bytes(summary)[:120]!r}: not the v{FORMAT_VERSION} summary")
    master = doc["master"]
    if master is not None:
        check_endpoint(master, "rendezvous digest master", RendezvousStateError)
    where = rank = neighbour = None
    key = node.key
    for line in (shard or b"").decode(errors="replace").split("\n"):
        if line.startswith(key + " "):
            fields = line.split(" ")
            if len(fields) != 4 or fields[1] not in _WHERE:
                raise RendezvousStateError(f"rendezvous digest shard line {line[:120]!r}: not '<key> <p|w|r> ...'")
            where = _WHERE[fields[1]]
            rank = None if fields[2] == "-" else int(fields[2])
            neighbour = None if fields[3] == "-" else NodeDesc.from_key(fields[3])
            break
    view = StateView(
        node,
        doc["round"],
        bool(doc["complete"]),
        bool(doc["closed"]),
        (doc["participants"], doc["wait_list"], doc["redundancy_list"]),
        doc["world_size"],
        where,
        rank,
        neighbour,
        master,
        doc["regrouped"],
        doc["survivors"],
    )
    return view, doc["shards"]
