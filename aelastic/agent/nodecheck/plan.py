"""The node check's decisions, pure: the groups of each check round, what the nodes tell each other (encoded,
versioned), and who is left out, and why. No I/O, no clock: :mod:`.parent` performs them.

Theory of operation
-------------------
A check runs in a rendezvous round with at least one *new* member (one whose agent has not passed a check yet).
Every member takes part, new or trusted: the trusted ones serve as peers and as the yardstick, but only new ones
can be left out. A node that passed is trusted for its agent's life: a node that slows down later is the running
job's to notice, and judging it again whenever a newcomer arrives would only add chances of a false verdict.

Each member's check process measures, per round, its compute (a matmul on its device: the fastest of several runs)
and, in a group with peers, its communication (gloo all-reduces with them: the median of several runs). Two
rounds, as DLRover's ``--network-check``: round 1 groups the ranks in order, two by two; round 2 sorts them by
their round-1 communication time (failures last) and pairs the fastest with the slowest, the second fastest with
the second slowest, and so on, so that a node held back by its round-1 peer meets a fast one. An odd one out joins
the last group (a group of three). A member whose check process or compute failed takes part in no further round,
so that its peers meet others.

Judgement, of the new members only (a member that serves the rendezvous store is judged, but stays: the job
cannot go on without its store, so what would have left it out is only said):

* a compute failure (in any round) leaves the node out: no peer was involved;
* a communication failure leaves it out when it failed in every round it had peers, each time beside peers whose
  own compute worked (a failure beside a peer that failed on its own is that peer's). Two rounds with different
  peers tell the faulty node from its victims; where the peers cannot differ (two members, or three: one group
  both times), every new member that failed both rounds is left out, since none can be cleared;
* slowness: a node whose compute time, or whose communication time (each the better of its rounds), exceeds
  ``slowdown`` times the median of every member's is left out. Of two figures the median is their mean, which
  neither can exceed twice: slowness is judged from three figures on.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from ...errors import RendezvousStateError

__all__ = [
    "VERSION",
    "Figures",
    "Groups",
    "Hello",
    "Round",
    "Verdict",
    "decode_figures",
    "decode_hello",
    "describe",
    "encode_figures",
    "encode_hello",
    "first_groups",
    "group_of",
    "judge",
    "second_groups",
]

VERSION: Final = 1  # of the messages below; a member that reads another version fails its round

M = TypeVar("M", "Hello", "Figures")

Groups = tuple[tuple[int, ...], ...]
"""The groups of one check round: ranks, each group sorted; the first rank's agent serves the group's store."""


@dataclass(frozen=True, slots=True)
class Hello:
    """What a member says when the check begins: whether it is new, where its agent serves the store of the groups
    it leads, why its check process cannot take part (``None``: it can), and whether it serves the rendezvous
    store (it then stays whatever its verdict)."""

    new: bool
    store: str
    error: str | None = None
    serves_rendezvous: bool = False


@dataclass(frozen=True, slots=True)
class Figures:
    """One member's result of one check round.

    Attributes:
        compute: seconds per matmul (the fastest run), ``None`` where it failed (``compute_error`` says why).
        comm: seconds per all-reduce with the group's peers (the median), ``None`` where it failed
            (``comm_error`` says why) or the member had no peer.
        device: what computed (``cpu``, ``cuda:0``, ...).
        size: the bytes each all-reduce carried.
    """

    compute: float | None = None
    comm: float | None = None
    compute_error: str | None = None
    comm_error: str | None = None
    device: str = ""
    size: int = 0

    @classmethod
    def failed(cls, why: str) -> Figures:
        """The figures of a member whose check process could not run the round (it takes part in no further one)."""
        return cls(compute_error=why, comm_error=why)


@dataclass(frozen=True, slots=True)
class Round:
    """One check round: its groups and every member's figures (members in no group have failed ones)."""

    groups: Groups
    figures: Mapping[int, Figures]


@dataclass(frozen=True, slots=True)
class Verdict:
    """The check's outcome: the new members left out (rank: why), those that would be but must stay (rank: why),
    and each member's best figures (seconds)."""

    left_out: Mapping[int, str]
    kept: Mapping[int, str]
    compute: Mapping[int, float]
    comm: Mapping[int, float]


# --- groups ---------------------------------------------------------------------------------------------------------


def _grouped(pairs: list[tuple[int, ...]], odd: int | None) -> Groups:
    if odd is not None:
        if pairs:
            pairs[-1] = (*pairs[-1], odd)
        else:
            pairs.append((odd,))
    return tuple(tuple(sorted(group)) for group in pairs)


def first_groups(ranks: Iterable[int]) -> Groups:
    """Round 1: the ranks in order, two by two; an odd one out joins the last pair (alone, it is a group of one)."""
    order = sorted(ranks)
    pairs: list[tuple[int, ...]] = [(order[i], order[i + 1]) for i in range(0, len(order) - 1, 2)]
    return _grouped(pairs, order[-1] if len(order) % 2 else None)


def second_groups(first: Round) -> Groups:
    """Round 2: the members whose compute worked in round 1, fastest communication first (failures last, then by
    rank), paired first with last, second with second last, ...; an odd one out (the middle) joins the last pair."""

    def key(rank: int) -> tuple[float, int]:
        comm = first.figures[rank].comm
        return (math.inf if comm is None else comm, rank)

    order = sorted((r for r, f in first.figures.items() if f.compute_error is None), key=key)
    n = len(order)
    pairs: list[tuple[int, ...]] = [(order[i], order[n - 1 - i]) for i in range(n // 2)]
    return _grouped(pairs, order[n // 2] if n % 2 else None)


def group_of(groups: Groups, rank: int) -> tuple[int, ...] | None:
    """The group ``rank`` is in, if any."""
    return next((group for group in groups if rank in group), None)


# --- judgement ------------------------------------------------------------------------------------------------------


def judge(rounds: Sequence[Round], new: Collection[int], slowdown: float, kept: Collection[int] = ()) -> Verdict:
    """Who of ``new`` is left out after ``rounds``, and why (see the module doc); ``slowdown`` is the bound on a
    figure over the median of all members' (``--node-check-slowdown``); members of ``kept`` stay whatever their
    verdict (it goes to :attr:`Verdict.kept`)."""
    members = sorted({rank for r in rounds for rank in r.figures})
    compute = _best(rounds, members, "compute")
    comm = _best(rounds, members, "comm")
    reasons: dict[int, list[str]] = {}
    for rank in sorted(set(new) & set(members)):
        why = reasons.setdefault(rank, [])
        errors = [f.compute_error for r in rounds if (f := r.figures[rank]).compute_error is not None]
        if errors:
            why.append(f"its check failed: {errors[0]}")
            continue
        why += _comm_failures(rounds, rank)
    for figures, what in ((compute, "matmul"), (comm, "all-reduce")):
        if len(figures) < 3:
            continue
        median = statistics.median(figures.values())
        for rank in reasons:
            value = figures.get(rank)
            if value is not None and value > slowdown * median:
                reasons[rank].append(
                    f"{what} {_ms(value)}, {value / median:.1f}x the median {_ms(median)} "
                    f"(bound: --node-check-slowdown {slowdown:g})"
                )
    found = {rank: "; ".join(why) for rank, why in reasons.items() if why}
    left_out = {rank: why for rank, why in found.items() if rank not in kept}
    return Verdict(left_out, {rank: why for rank, why in found.items() if rank in kept}, compute, comm)


def _best(rounds: Sequence[Round], members: Iterable[int], field: str) -> dict[int, float]:
    """Each member's best (lowest) figure of ``field`` over the rounds, where it has one."""
    best: dict[int, float] = {}
    for rank in members:
        values = [v for r in rounds if (v := getattr(r.figures[rank], field)) is not None]
        if values:
            best[rank] = min(values)
    return best


def _comm_failures(rounds: Sequence[Round], rank: int) -> list[str]:
    """Why ``rank``'s communication is faulty (one reason, or none): it failed in every round in which it had
    peers, each time beside peers whose compute worked."""
    failures = []
    for number, r in enumerate(rounds, 1):
        group = group_of(r.groups, rank)
        if group is None or len(group) < 2:
            continue
        peers = [p for p in group if p != rank]
        error = r.figures[rank].comm_error
        if error is None or any(r.figures[p].compute_error is not None for p in peers):
            return []  # it worked, or its failure is a faulty peer's
        failures.append(f"with rank {', '.join(map(str, peers))} in round {number}: {error}")
    if not failures:
        return []
    return [f"its all-reduce failed in every round: {'; '.join(failures)}"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms"


def describe(verdict: Verdict, rounds: Sequence[Round]) -> str:
    """Each member's figures, for the log: ``rank 0 (cpu): matmul 9.81 ms, all-reduce of 4 MiB 10.2 ms; ...``."""
    parts = []
    for rank in sorted({rank for r in rounds for rank in r.figures}):
        known = [r.figures[rank] for r in rounds]
        device = next((f.device for f in known if f.device), "?")
        size = next((f.size for f in known if f.size), 0)
        matmul = verdict.compute.get(rank)
        reduce = verdict.comm.get(rank)
        text = f"rank {rank} ({device}): matmul {'failed' if matmul is None else _ms(matmul)}"
        if reduce is not None:
            text += f", all-reduce of {size / 2**20:g} MiB {_ms(reduce)}"
        elif any(f.comm_error for f in known):
            text += ", all-reduce failed"
        parts.append(text)
    return "; ".join(parts)


# --- messages -------------------------------------------------------------------------------------------------------


def encode_hello(hello: Hello) -> bytes:
    return _encode(hello)


def decode_hello(data: bytes, rank: int) -> Hello:
    """Raises :class:`~aelastic.errors.RendezvousStateError` for bytes that are not a hello of this version."""
    hello = _decode(Hello, data, rank, "hello")
    flags = (hello.new, hello.serves_rendezvous)
    if not all(isinstance(flag, bool) for flag in flags) or not isinstance(hello.store, str) or not _text(hello.error):
        raise RendezvousStateError(f"node check: rank {rank}'s hello is malformed: {data[:200]!r}")
    return hello


def encode_figures(figures: Figures) -> bytes:
    return _encode(figures)


def decode_figures(data: bytes, rank: int) -> Figures:
    """Raises :class:`~aelastic.errors.RendezvousStateError` for bytes that are not figures of this version."""
    figures = _decode(Figures, data, rank, "figures")
    seconds = (figures.compute, figures.comm)
    if (
        not all(v is None or (isinstance(v, int | float) and v >= 0) for v in seconds)
        or not all(map(_text, (figures.compute_error, figures.comm_error)))
        or not isinstance(figures.device, str)
        or not isinstance(figures.size, int)
    ):
        raise RendezvousStateError(f"node check: rank {rank}'s figures are malformed: {data[:200]!r}")
    return figures


def _encode(message: Hello | Figures) -> bytes:
    return json.dumps({"v": VERSION, **{name: getattr(message, name) for name in type(message).__slots__}}).encode()


def _decode(kind: type[M], data: bytes, rank: int, what: str) -> M:
    fields = _fields(data, rank, what)
    try:
        return kind(**{name: fields[name] for name in kind.__slots__})
    except KeyError as exc:
        raise RendezvousStateError(f"node check: rank {rank}'s {what} lacks {exc}") from None


def _text(value: object) -> bool:
    return value is None or isinstance(value, str)


def _fields(data: bytes, rank: int, what: str) -> dict[str, Any]:
    try:
        fields = json.loads(data)
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        raise RendezvousStateError(f"node check: rank {rank}'s {what} is not a JSON object: {data[:200]!r}")
    if fields.get("v") != VERSION:
        raise RendezvousStateError(
            f"node check: rank {rank}'s {what} is of version {fields.get('v')!r}, this agent reads {VERSION} "
            "(every node must run the same aelastic)"
        )
    return fields
