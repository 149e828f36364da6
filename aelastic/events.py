"""Events in torch's schema (``torch.distributed.elastic.events``), with real timestamps, and where they go.

An event is one JSON object per line: ``{"name", "source", "timestamp", "metadata"}``, torch's ``Event``. The
agent records torch's ``torchelastic.worker.status.<STATE>`` events with torch's metadata keys; the rendezvous
records what torch drops (issue #63846): ``aelastic.rendezvous.{join,round_complete,member_dead,closed}``, in the
same schema, so that one parser reads every line. Unlike torch's, ``timestamp`` is set: integer epoch
milliseconds (torch's field is an int, and always 0).

Where events go is chosen once per launch by name (``--event-log-handler``): ``null`` (the default: nothing is
built or serialized), ``console`` (one bare JSON line per event on stderr, as torch's), ``file`` (JSON lines in
``<log dir>/events.jsonl``), or a handler registered by a package under the ``aelastic.event_handlers`` entry-point
group (a factory called with the log dir that returns a :class:`logging.Handler`). The active log is a context
variable that :func:`open_event_log` sets for the launch: the agent's and the rendezvous handler's tasks inherit it,
and :func:`record` is a no-op when there is none.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Union

from .errors import ConfigurationError

__all__ = [
    "ENTRY_POINT_GROUP",
    "Event",
    "EventLog",
    "EventSource",
    "HandlerFactory",
    "open_event_log",
    "record",
    "register_event_handler",
]

ENTRY_POINT_GROUP = "aelastic.event_handlers"

EventMetadataValue = Union[str, int, float, bool, None, list[int], list[str]]  # noqa: UP007 (py3.10 runtime alias)
HandlerFactory = Callable[[Path], logging.Handler]


class EventSource(str, enum.Enum):
    """torch's ``EventSource``: who the event is about."""

    AGENT = "AGENT"
    WORKER = "WORKER"


@dataclass
class Event:
    """torch's ``Event``; ``timestamp`` is epoch milliseconds (torch leaves it 0)."""

    name: str
    source: EventSource
    timestamp: int = 0
    metadata: dict[str, EventMetadataValue] = field(default_factory=dict)

    def serialize(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def deserialize(text: str) -> Event:
        data = json.loads(text)
        data["source"] = EventSource[data["source"]]
        return Event(**data)


def _stderr_handler(log_dir: Path) -> logging.Handler:
    return logging.StreamHandler(sys.stderr)


def _file_handler(log_dir: Path) -> logging.Handler:
    return logging.FileHandler(log_dir / "events.jsonl", encoding="utf-8")


_factories: dict[str, HandlerFactory] = {"console": _stderr_handler, "file": _file_handler}


def register_event_handler(name: str, factory: HandlerFactory) -> None:
    """Make ``--event-log-handler NAME`` send events to ``factory(log_dir)``; a package can instead declare the
    factory under the ``aelastic.event_handlers`` entry-point group."""
    _factories[name] = factory


def _factory(name: str) -> HandlerFactory:
    if name in _factories:
        return _factories[name]
    from importlib.metadata import entry_points

    for entry in entry_points(group=ENTRY_POINT_GROUP, name=name):
        factory: HandlerFactory = entry.load()
        return factory
    known = ", ".join(["null", *sorted(_factories)])
    raise ConfigurationError(
        f"--event-log-handler {name!r}: no such handler (known: {known}; a package adds one under the "
        f"{ENTRY_POINT_GROUP!r} entry-point group)"
    )


def check_event_handler(name: str) -> None:
    """Refuse an unknown handler name before anything starts."""
    if name != "null":
        _factory(name)


class EventLog:
    """Where this launch's events go: a private logger (no propagation, so the application's logging config
    neither formats nor duplicates the JSON lines) with the chosen handler."""

    def __init__(self, handler: logging.Handler) -> None:
        self._handler = handler
        self._logger = logging.getLogger(f"aelastic.events.{id(self)}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(handler)
        self.hostname = socket.getfqdn(socket.gethostname())

    def __repr__(self) -> str:
        return f"<EventLog handler={self._handler!r}>"

    def record(self, event: Event) -> None:
        self._logger.info(event.serialize())

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()


_current: ContextVar[EventLog | None] = ContextVar("aelastic_event_log", default=None)


@contextmanager
def open_event_log(name: str, log_dir: Path) -> Iterator[EventLog | None]:
    """Make ``name``'s handler the destination of :func:`record` in this context (``null``: none at all)."""
    if name == "null":
        yield None
        return
    log = EventLog(_factory(name)(log_dir))
    token = _current.set(log)
    try:
        yield log
    finally:
        _current.reset(token)
        log.close()


def active() -> EventLog | None:
    """The event log of this context, if any: callers build an event's metadata only when there is one."""
    return _current.get()


def record(name: str, source: EventSource, metadata: dict[str, EventMetadataValue]) -> None:
    """Record an event now (real timestamp) in this context's log; nothing when events are off."""
    log = _current.get()
    if log is not None:
        log.record(Event(name, source, time.time_ns() // 1_000_000, metadata))


def record_rendezvous(what: str, run_id: str, node: str, **details: EventMetadataValue) -> None:
    """A rendezvous event ``aelastic.rendezvous.<what>``; metadata keys follow torch's ``RdzvEvent`` fields."""
    log = _current.get()
    if log is not None:
        metadata: dict[str, EventMetadataValue] = {
            "run_id": run_id,
            "hostname": log.hostname,
            "pid": os.getpid(),
            "node": node,
        }
        metadata.update(details)
        log.record(Event(f"aelastic.rendezvous.{what}", EventSource.AGENT, time.time_ns() // 1_000_000, metadata))
