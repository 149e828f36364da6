"""The one error tree of aelastic.

Every error aelastic raises on purpose derives from :class:`AelasticError`. Foreign exceptions (``OSError``
from a socket, a malformed reply) are translated once, where they enter aelastic, with ``raise ... from exc``.
Messages name the value, the rule and, where there is one, the remedy.
"""

from __future__ import annotations

__all__ = [
    "AelasticError",
    "ConfigurationError",
    "QueueEmptyError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StoreConnectionError",
    "StoreError",
    "StoreProtocolError",
]


class AelasticError(Exception):
    """Base class of every error aelastic raises on purpose."""


class ConfigurationError(AelasticError, ValueError):
    """A value given by the user breaks a rule; the message names the value and the rule."""


class StoreError(AelasticError):
    """A key-value store operation failed."""


class StoreConnectionError(StoreError, ConnectionError):
    """The store at an address could not be reached, or the connection to it broke."""


class StoreProtocolError(StoreError):
    """A peer sent bytes that are not torch's TCPStore protocol, or that break a configured limit."""


class QueueEmptyError(StoreError):
    """``queue_pop(block=False)`` found the queue empty (torch's ``DistQueueEmptyError``)."""


class RendezvousError(AelasticError):
    """Base class of rendezvous errors (torch's names)."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the job is over, no new round will form."""


class RendezvousTimeoutError(RendezvousError):
    """The rendezvous did not complete in time (the join timeout passed before ``min_nodes`` joined)."""


class RendezvousConnectionError(RendezvousError):
    """The rendezvous backend could not be reached."""


class RendezvousStateError(RendezvousError):
    """The shared rendezvous state is unreadable or inconsistent."""


class RendezvousGracefulExitError(RendezvousError):
    """A node in reserve (beyond ``max_nodes``) was released because the rendezvous closed."""
