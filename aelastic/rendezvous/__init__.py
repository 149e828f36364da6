"""Rendezvous: how the nodes of one run agree on who is in the next round, and on everyone's rank.

``state`` is the pure state machine (torch's ``DynamicRendezvousHandler`` semantics, no I/O, no clocks);
``dynamic`` runs it against a backend driver (``backends``); ``api`` is the handler interface the agent uses.

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
    from .api import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousParameters,
        RendezvousStoreInfo,
        check_parameters,
        open_rendezvous,
        register_backend,
    )

_LAZY = {
    name: ".api"
    for name in (
        "RendezvousHandler",
        "RendezvousInfo",
        "RendezvousParameters",
        "RendezvousStoreInfo",
        "check_parameters",
        "open_rendezvous",
        "register_backend",
    )
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
