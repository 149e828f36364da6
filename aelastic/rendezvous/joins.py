"""Join requests, and how every reader folds the requests pending on a state into it.

Joining is the one write every node makes, all at once when a job starts; N nodes compare-and-setting one state
would cost O(N^2) attempts of an O(N) value. So a node that decides to add itself (ADD_TO_PARTICIPANTS, _WAIT_LIST,
_REDUNDANCY_LIST) appends a small join request instead (the backend keeps requests in order beside the state),
and every reader applies the requests pending on the state it read: the state a node decides on is
``fold_joins(committed state, pending requests)``. Any write (a compare-and-set) is decided on that folded state
and consumes the requests it saw; a request appended after the read makes the write fail, so none is lost or
applied twice. Each request is admitted with exactly the join decision (``JOIN_RULES``) a node not yet listed
would take for itself, with the requester's own max_nodes, so every reader folds the same requests the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from ..errors import ConfigurationError
from .state import Action, completed
from .values import NodeDesc, RendezvousState, check_endpoint, is_int

__all__ = ["JOIN_REQUESTS", "JoinRequest", "fold_joins"]

JOIN_REQUESTS: Final[frozenset[Action]] = frozenset(
    {Action.ADD_TO_PARTICIPANTS, Action.ADD_TO_WAIT_LIST, Action.ADD_TO_REDUNDANCY_LIST}
)
"""The write actions a node performs by appending a join request rather than by a compare-and-set."""


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """A node's request to be added to the state, with the ``max_nodes`` it was configured with and its bootstrap
    endpoint (``host:port``, already listening): where its workers' store is served if it becomes rank 0, so
    every member learns the address from the state that completes the round, with no lookup after it."""

    node: NodeDesc
    max_nodes: int
    endpoint: str | None = None

    def __post_init__(self) -> None:
        if not is_int(self.max_nodes) or self.max_nodes < 1:
            raise ConfigurationError(f"JoinRequest.max_nodes={self.max_nodes!r}: must be an integer >= 1")
        if self.endpoint is not None:
            check_endpoint(self.endpoint, "JoinRequest.endpoint", ConfigurationError)


def fold_joins(state: RendezvousState, requests: Iterable[JoinRequest]) -> RendezvousState:
    """``state`` with ``requests`` applied in order, as if each requester had written its own join.

    A request is admitted as :func:`decide_join` admits a node that has time left and is listed nowhere, or on the
    wait list of a round that is over: to the participants of a gathering round (the ``max_nodes``-th completes
    it, as :func:`apply` does), to the wait list of a complete round with room, to the redundancy list of a full
    one. It is dropped when the node is otherwise listed, when the rendezvous is closed, or while a gathering
    round is full; the node then decides again on what it reads. An admitted request's endpoint becomes its node's.
    Linear in the size of the state and the number of requests (moving a node off the wait list is linear in the
    wait list).
    """
    if state.closed:
        return state
    listed = set(state.all_nodes())
    participants, wait_list, reserve = list(state.participants), list(state.wait_list), list(state.redundancy_list)
    complete, rank_order, endpoints, lost = state.complete, state.rank_order, dict(state.endpoints), state.lost
    changed = False
    for request in requests:
        node = request.node
        # Listed nodes are skipped, except one on the wait list once its round is over: it joins the next.
        if node in listed and (complete or node not in wait_list):
            continue
        full = len(participants) >= request.max_nodes
        if full and not complete:
            continue
        if request.endpoint is not None:
            endpoints[node] = request.endpoint
        if complete:
            (reserve if full else wait_list).append(node)
        else:
            if node in listed:
                wait_list.remove(node)
            participants.append(node)
            if len(participants) >= request.max_nodes:
                done = completed(
                    dataclasses.replace(
                        state, participants=tuple(participants), wait_list=tuple(wait_list), endpoints=endpoints
                    )
                )
                participants, complete, rank_order = list(done.participants), True, done.rank_order
                endpoints, lost = dict(done.endpoints), done.lost
        listed.add(node)
        changed = True
    if not changed:
        return state
    return dataclasses.replace(
        state,
        complete=complete,
        participants=tuple(participants),
        wait_list=tuple(wait_list),
        redundancy_list=tuple(reserve),
        rank_order=rank_order,
        endpoints=endpoints,
        lost=lost,
    )
