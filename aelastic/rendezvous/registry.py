"""The rendezvous backends by name: :func:`register_backend`, :func:`lookup`, :func:`check_parameters` and
:func:`open_rendezvous` (torch's handler registry, async).

An entry (:class:`BackendEntry`) is what a backend offers beside its handler: a check of its parameters without
I/O, and, if it keeps shared state, a read-only reader of that state and the protocol settings its nodes derive,
which ``aelastic status`` uses (so status knows no backend by name). The built-in backends (``c10d``, ``static``,
``etcd``, ``etcd-v2``) are imported on first lookup, each alone: a c10d node never imports etcd's client. Other
names are registered by :func:`register_backend` or found through the entry-point group
``aelastic.rendezvous_backends``.

Imports go one way: this module imports the backends; no backend imports it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Final, Protocol

from .._groups import single_error
from ..errors import ConfigurationError
from .api import JoinObserver, RendezvousHandler, RendezvousParameters
from .backends.base import StateReader
from .settings import ConfKey
from .values import RendezvousSettings

__all__ = [
    "BackendEntry",
    "CheckParameters",
    "OpenHandler",
    "OpenReader",
    "check_parameters",
    "lookup",
    "open_rendezvous",
    "readable_backends",
    "register_backend",
]


class OpenHandler(Protocol):
    """Opens a backend's handler: ``opener(params, observer=...)`` is an async context manager yielding it.

    ``observer`` is the :data:`~aelastic.rendezvous.api.JoinObserver` of :func:`open_rendezvous` (``None``: no
    one observes); a handler that runs the dynamic rendezvous hands it to
    :func:`~aelastic.rendezvous.dynamic.open_dynamic_rendezvous`, one without join steps ignores it.
    """

    def __call__(
        self, params: RendezvousParameters, *, observer: JoinObserver | None
    ) -> AbstractAsyncContextManager[RendezvousHandler]: ...


CheckParameters = Callable[[RendezvousParameters], object]
"""Raises :class:`~aelastic.errors.ConfigurationError` for parameters the opener would refuse, without I/O."""

OpenReader = Callable[[RendezvousParameters], AbstractAsyncContextManager[StateReader]]
"""Opens a read-only reader of the state a backend keeps (``aelastic status``): it joins, writes and creates
nothing."""

SettingsOf = Callable[[RendezvousParameters], RendezvousSettings]
"""The protocol settings (node counts, windows) the nodes of these parameters derive."""


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """One registered backend; see the module docstring. ``open_reader`` None: the backend keeps no shared state
    to show (``static``); ``settings`` None (with a reader): the shared timing keys
    (:class:`~aelastic.rendezvous.settings.TimingSettings`) give them. ``keys``: the ``--rdzv-conf`` keys it
    reads (the reference lists them; empty: not declared)."""

    name: str
    open: OpenHandler
    check: CheckParameters | None = None
    open_reader: OpenReader | None = None
    settings: SettingsOf | None = None
    keys: tuple[ConfKey, ...] = ()

    def rendezvous_settings(self, params: RendezvousParameters) -> RendezvousSettings:
        """The protocol settings ``params`` give, as the backend's nodes derive them."""
        if self.settings is not None:
            return self.settings(params)
        from .settings import TimingSettings

        return TimingSettings.from_parameters(params).rendezvous


_BUILTIN: Final = frozenset({"c10d", "static", "etcd", "etcd-v2"})
_entries: dict[str, BackendEntry] = {}
_ENTRY_POINT_GROUP: Final = "aelastic.rendezvous_backends"


def _builtin(name: str) -> BackendEntry:
    """The entry of a built-in backend, its module imported now."""
    if name == "c10d":
        from .backends import c10d

        return BackendEntry(
            "c10d", c10d.open_c10d_rendezvous, c10d.c10d_setup, c10d.open_c10d_reader, c10d.c10d_settings,
            c10d.C10D_KEYS,
        )  # fmt: skip
    if name == "static":
        from .backends import static

        return BackendEntry("static", static.open_static_rendezvous, static.static_setup, keys=static.STATIC_KEYS)
    from .backends import etcd, etcd_conf

    opener = etcd.open_etcd_rendezvous if name == "etcd" else etcd.open_etcd_v2_rendezvous
    return BackendEntry(
        name, opener, etcd_conf.etcd_setup, etcd.open_etcd_reader, etcd_conf.etcd_settings, etcd_conf.ETCD_KEYS
    )


def register_backend(
    name: str,
    opener: OpenHandler | BackendEntry,
    *,
    check: CheckParameters | None = None,
    open_reader: OpenReader | None = None,
    settings: SettingsOf | None = None,
    keys: tuple[ConfKey, ...] = (),
) -> None:
    """Register a backend: ``opener(params, observer=...)`` is an async context manager yielding a handler.

    ``check(params)``, if given, raises :class:`~aelastic.errors.ConfigurationError` for parameters the opener
    would refuse, without any I/O (its return value is ignored); :func:`check_parameters` runs it.
    ``open_reader(params)``, if given, opens a read-only :class:`~aelastic.rendezvous.backends.StateReader` of
    the backend's state, which ``aelastic status`` shows with the ``settings(params)`` the nodes derive.
    ``keys``: the ``--rdzv-conf`` keys it reads (:class:`~aelastic.rendezvous.settings.ConfKey`). A
    :class:`BackendEntry` may be given instead of the opener and the keywords.

    Third-party packages register through the entry-point group ``aelastic.rendezvous_backends``; the entry point
    names the opener or a :class:`BackendEntry`.

    Raises:
        ConfigurationError: ``name`` is a built-in backend's, or registered with another opener.
    """
    entry = (
        opener
        if isinstance(opener, BackendEntry)
        else BackendEntry(name, opener, check=check, open_reader=open_reader, settings=settings, keys=keys)
    )
    if name in _BUILTIN:
        raise ConfigurationError(f"rendezvous backend {name!r} is built in; register another name")
    existing = _entries.get(name)
    if existing is not None and existing.open is not entry.open:
        raise ConfigurationError(f"rendezvous backend {name!r} is already registered by {existing.open!r}")
    _entries[name] = entry


def lookup(name: str) -> BackendEntry:
    """The entry of the backend called ``name``.

    Raises:
        ConfigurationError: no backend has that name (naming the known ones).
    """
    entry = _entries.get(name)
    if entry is not None:
        return entry
    if name in _BUILTIN:
        return _entries.setdefault(name, _builtin(name))
    # Only for a name no built-in backend has: scanning the installed packages costs a launch tens of ms.
    from importlib.metadata import entry_points

    for ep in entry_points(group=_ENTRY_POINT_GROUP):
        if ep.name == name:
            register_backend(name, ep.load())
            return _entries[name]
    known = ", ".join(sorted(_BUILTIN | set(_entries)))
    raise ConfigurationError(f"--rdzv-backend {name!r}: unknown rendezvous backend; known: {known}")


def readable_backends() -> list[str]:
    """The names of the backends known so far whose state ``aelastic status`` can read (the built-in ones among
    them whether or not they were looked up)."""
    return sorted({"c10d", "etcd", "etcd-v2"} | {n for n, e in _entries.items() if e.open_reader is not None})


def check_parameters(params: RendezvousParameters) -> None:
    """Refuse, without opening anything, what opening ``params`` would refuse before any I/O: an unknown backend,
    a bad ``--rdzv-conf`` value of a key the backend reads, a malformed endpoint (the command line checks before
    it starts). A key the backend does not know is warned about, not refused.

    Raises:
        ConfigurationError: naming the backend, key or value and the rule.
    """
    entry = lookup(params.backend)
    if entry.check is not None:
        entry.check(params)


@asynccontextmanager
async def open_rendezvous(
    params: RendezvousParameters, *, observer: JoinObserver | None = None
) -> AsyncIterator[RendezvousHandler]:
    """Open the handler for ``params.backend``: it owns its background tasks (keep-alive, the store servers it may
    host) in its own task group, and leaving the context stops them. ``observer`` is called at every step of the
    node's exit and join (see :data:`~aelastic.rendezvous.api.JoinObserver`).

    One error, from opening, from the handler's background tasks or from the body, is raised as itself
    (``except RendezvousTimeoutError`` works), never wrapped in the ExceptionGroups of the task groups inside; a
    group comes out only when several errors happened together (see :mod:`aelastic._groups`).

    Raises:
        ConfigurationError: an unknown backend, a bad ``--rdzv-conf`` value or endpoint.
        RendezvousConnectionError: the backend could not be reached, or stopped answering.
    """
    entry = lookup(params.backend)
    with single_error():
        async with entry.open(params, observer=observer) as handler:
            yield handler
