"""Rendezvous: how the nodes of one run agree on who is in the next round, and on everyone's rank.

The pure core (no I/O, no clocks): ``state`` (the state machine: values, rule tables, decisions; torch's
``DynamicRendezvousHandler`` semantics), ``joins`` (folding join requests into a state) and ``codec`` (the bytes
of states, join requests and digests). ``dynamic`` runs the core against a backend driver (``backends``: the
protocol, and one module per built-in backend); ``api`` holds the handler interface the agent uses and its
values, ``settings`` the ``--rdzv-conf`` parsing shared by the backends, ``registry`` the backends by name, and
``testing`` the conformance kit for a backend. Imports go one way: ``registry`` -> ``backends`` -> ``dynamic``
-> ``api`` -> the core.

This package exports the names of torch's ``torch.distributed.elastic.rendezvous`` that aelastic has (the handler
is async; torch's handler registry is :func:`register_backend` and :func:`open_rendezvous`), imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ..errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

if TYPE_CHECKING:
    from .api import RendezvousHandler, RendezvousInfo, RendezvousParameters, RendezvousStoreInfo
    from .registry import check_parameters, open_rendezvous, register_backend

_LAZY = {
    **{name: ".api" for name in ("RendezvousHandler", "RendezvousInfo", "RendezvousParameters", "RendezvousStoreInfo")},
    **{name: ".registry" for name in ("check_parameters", "open_rendezvous", "register_backend")},
}

__all__ = [
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeoutError",
    "check_parameters",
    "open_rendezvous",
    "register_backend",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
