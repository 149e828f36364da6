"""What a node knows of the rendezvous's shared state: a backend's read with its pending join requests folded in
(decoded once, folded incrementally: :class:`FoldCache`), the node's last reads (:class:`Known`) and its own join
request (:class:`OwnRequest`); and which folds change what other nodes wait for, so that they must be written."""

from __future__ import annotations

import dataclasses
import functools

from .api import View
from .backends.base import Versioned
from .codec import decode_join_request, decode_state
from .joins import fold_joins
from .state import regrouped
from .values import RendezvousSettings, RendezvousState

__all__ = [
    "FoldCache",
    "Known",
    "OwnRequest",
    "changes_what_others_wait_for",
    "committed_state",
    "departed",
    "state_of",
]


# Nodes simulated as tasks of one process read the same bytes many times: decode each value once. (Pure functions
# of bytes: sharing their results between handlers shares no state.)
_decode_state = functools.lru_cache(maxsize=8)(decode_state)


_decode_join_request = functools.lru_cache(maxsize=1 << 16)(decode_join_request)


def committed_state(seen: Versioned) -> RendezvousState:
    """The state as last written, without the join requests pending on it."""
    return _decode_state(seen.data) if seen.data is not None else RendezvousState()


class FoldCache:
    """A handler's last fold. It reads the same written state again and again with a few more join requests
    pending each time: fold only those, onto the last result (``fold_joins`` is a left fold, so the result is the
    same). Counts its folds for the handler's statistics."""

    def __init__(self) -> None:
        self._last: tuple[bytes | None, tuple[bytes, ...], RendezvousState] = (None, (), RendezvousState())
        self.folds = 0
        self.requests_folded = 0

    def __repr__(self) -> str:
        return f"<FoldCache folds={self.folds} requests_folded={self.requests_folded}>"

    def state_of(self, seen: Versioned) -> RendezvousState:
        data, pending, folded = self._last
        done = len(pending)
        if seen.data == data and seen.pending[:done] == pending:
            todo = seen.pending[done:]
            state = fold_joins(folded, map(_decode_join_request, todo))
        else:
            todo = seen.pending
            state = fold_joins(committed_state(seen), map(_decode_join_request, todo))
        self.folds += bool(todo)
        self.requests_folded += len(todo)
        self._last = (seen.data, seen.pending, state)
        return state


def state_of(seen: Versioned) -> RendezvousState:
    """The rendezvous state that a backend read (``get_state``) holds: the written state with its pending join
    requests applied (``fold_joins``); what every node decides on."""
    return fold_joins(committed_state(seen), map(_decode_join_request, seen.pending))


@dataclasses.dataclass(slots=True)
class Known:
    """What this node knows of the shared state, from its reads (see the module docstring's "Reads")."""

    seen: Versioned = dataclasses.field(default_factory=lambda: Versioned(0, None))  # the last whole read: what a
    # write compare-and-sets against
    committed: RendezvousState = dataclasses.field(default_factory=RendezvousState)  # the state as last written
    state: View = dataclasses.field(default_factory=RendezvousState)  # what this node decides on: the whole state
    # (written, with the pending join requests folded in), or its digest's view
    version: int = -1  # the newest version this node read, whole or as a digest (-1: none yet)
    joined: int = 0  # the join requests consumed up to that version (digests)
    folds: FoldCache = dataclasses.field(default_factory=lambda: FoldCache())

    def adopt(self, seen: Versioned) -> None:
        """Take a whole read, unless a newer version was read already."""
        if seen.version >= self.version:
            self.seen, self.version, self.joined = seen, seen.version, seen.joined
            self.committed = committed_state(seen)
            self.state = self.folds.state_of(seen)


@dataclasses.dataclass(slots=True)
class OwnRequest:
    """This node's latest join request, and whether publishing its fold is this node's job."""

    request: bytes | None = None
    ticket: int | None = None  # its ticket (digests): folded once a version's ``joined`` reaches it
    publish: bool = False  # digests: this node's request changes what others wait for, so it writes the fold


def changes_what_others_wait_for(written: RendezvousState, view: RendezvousState, settings: RendezvousSettings) -> bool:
    """Whether the join requests folded into ``view`` change what other nodes wait for, so that it must be written
    (which wakes them): the round completed, a node joined the wait list of a complete round, the round reached
    ``min_nodes`` (the others start their last call when they see it), or the round regrouped after a loss (fast
    quorum: the participants complete it when they see it)."""
    quorum = settings.min_nodes
    return (
        view.complete != written.complete
        or len(view.wait_list) > len(written.wait_list)
        or len(written.participants) < quorum <= len(view.participants)
        or (settings.fast_quorum and regrouped(view) and not regrouped(written))
    )


def departed(state: RendezvousState) -> frozenset[int]:
    """The ranks of a complete round whose nodes are no longer participants (members only ever leave it)."""
    members = set(state.participants)
    return frozenset(rank for rank, node in enumerate(state.rank_order) if node not in members)
