"""The one error tree of aelastic.

Every error aelastic raises on purpose derives from :class:`AelasticError`. Foreign exceptions (``OSError``
from a socket, a malformed reply) are translated once, where they enter aelastic, with ``raise ... from exc``.
Messages name the value, the rule and, where there is one, the remedy.

``aelastic run`` exits with the ``exit_code`` of the error that ended it: 0 when the job succeeded, 1 when it failed
(a worker's failure with no restart left: ``ChildFailedError``; any other aelastic error), 2 on bad input
(:class:`ConfigurationError`: nothing was started), 3 when the job made no progress (``NoProgressError``: its last
attempts failed the same way; requeueing it would fail again), 4 when a worker outlived SIGKILL
(:class:`UnkillableWorkerError`: replace the node), 128+N when signal N stopped it.
"""

from __future__ import annotations

__all__ = [
    "AelasticError",
    "CheckpointError",
    "ConfigurationError",
    "EtcdCompactedError",
    "EtcdConnectionError",
    "EtcdError",
    "EtcdLeaseExpiredError",
    "EtcdRequestError",
    "NodeCheckError",
    "QueueEmptyError",
    "ReaperError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StoreAuthError",
    "StoreBindError",
    "StoreConnectionError",
    "StoreError",
    "StoreProtocolError",
    "TimerServerUnavailableError",
    "UnkillableWorkerError",
]


class AelasticError(Exception):
    """Base class of every error aelastic raises on purpose."""

    exit_code: int = 1  # what ``aelastic run`` exits with when this error ends it


class ConfigurationError(AelasticError, ValueError):
    """A value given by the user breaks a rule; the message names the value and the rule."""

    exit_code = 2


class StoreError(AelasticError):
    """A key-value store operation failed."""


class StoreConnectionError(StoreError, ConnectionError):
    """The store at an address could not be reached, or the connection to it broke."""


class StoreAuthError(StoreConnectionError):
    """The store refused this client's auth token (or its lack of one); retrying cannot help."""


class StoreBindError(StoreError, OSError):
    """A store server could not listen on its address (in use, not this host's, not permitted, not resolvable).

    The message names the address; ``errno`` is the socket error's (``EADDRINUSE`` for a port in use). An
    :class:`OSError`, as the socket error it replaces."""


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


class EtcdError(AelasticError):
    """Base class of errors talking to etcd (the v3 API)."""


class EtcdConnectionError(EtcdError, StoreConnectionError):
    """No etcd endpoint could be reached (nothing listening, wrong scheme, TLS mismatch), or the connection broke
    while the outcome of a request was unknown. The message names the endpoint(s)."""


class EtcdRequestError(EtcdError):
    """etcd answered a request with an error (its gRPC status ``code`` and ``message``)."""

    def __init__(self, message: str, *, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class EtcdCompactedError(EtcdError):
    """A watch asked for history that etcd has compacted away (``compact_revision`` is the oldest it keeps)."""

    def __init__(self, message: str, *, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class EtcdLeaseExpiredError(EtcdError):
    """A lease was kept alive after etcd had expired or revoked it; its keys are gone."""


class NodeCheckError(AelasticError):
    """This node failed the node check (``--node-check``, :mod:`aelastic.agent.nodecheck`) and was left out of
    the job, the other nodes going on without it; or the check could not run (a node without ``--node-check``).
    The message says which, with the figures."""


class ReaperError(AelasticError):
    """The reaper sidecar is gone: worker groups can no longer be registered for cleanup after an agent crash."""


class UnkillableWorkerError(AelasticError):
    """A worker outlived SIGKILL (uninterruptible sleep: a dead mount, a wedged device): the agent cannot free its
    node, and leaves so that the scheduler replaces it. ``aelastic run`` exits with status 4."""

    exit_code = 4


class CheckpointError(AelasticError):
    """An in-memory checkpoint could not be saved or loaded (:mod:`aelastic.checkpoint`): a value the state may not
    hold, a state over the agent's memory bound, no agent to hold it; the previous checkpoint is left whole."""


class TimerServerUnavailableError(AelasticError):
    """The timer FIFO has no reader: the agent that served it is gone (raised in the worker by
    :mod:`aelastic.worker`)."""
