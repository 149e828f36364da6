"""Rendezvous backends: the protocol a backend driver implements, and the built-in backends, one module each.

``c10d`` (:mod:`.c10d`, its state driver :mod:`.store`, its store :mod:`.hosting`), ``static`` (:mod:`.static`),
``etcd`` and torch's ``etcd-v2`` alias (:mod:`.etcd`), and the in-process ``memory`` driver for tests
(:mod:`.memory`). The registry (:mod:`aelastic.rendezvous.registry`) opens them by name; nothing here registers
anything, so importing a backend imports only what it needs (``etcd`` pulls in its HTTP client).

The public protocol, for a third-party backend: a :class:`RendezvousBackend` driver (versioned state, join
requests, liveness, a store; :mod:`.base` says what each method promises), a :class:`StateReader` for
``aelastic status``, the values they pass (:class:`Versioned`, :class:`DigestRead`, :class:`Digest`), and
:func:`~aelastic.rendezvous.dynamic.open_dynamic_rendezvous`, which runs the rendezvous over a driver. The
conformance kit :mod:`aelastic.rendezvous.testing` checks a backend against the rendezvous guarantees.
"""

from __future__ import annotations

from ..codec import Digest
from .base import DigestRead, RendezvousBackend, StateReader, Versioned

__all__ = ["Digest", "DigestRead", "RendezvousBackend", "StateReader", "Versioned"]
