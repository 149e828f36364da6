"""torch's ``torchelastic.worker.status.<STATE>`` events for the agent's transitions (``aelastic.events``).

The metadata is torch's ``SimpleElasticAgent._construct_event``, key for key: top-level ``run_id, global_rank,
group_rank, worker_id, role, hostname, state, total_run_time, rdzv_backend, raw_error, metadata, agent_restarts,
duration_ms``, with ``metadata`` a JSON *string* holding ``group_world_size`` and ``entry_point`` and, for worker
events, one-element lists ``local_rank, role_rank, role_world_size, exit_code, worker_pid``. Everything is built
from an :class:`AgentSnapshot`, the agent's figures at the moment of the event, which the agent takes only when an
event log is active; nothing here reads the agent itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import events
from ..events import EventMetadataValue, EventSource
from .workers import Worker

if TYPE_CHECKING:
    from .incidents.ledger import Incident
    from .processes import GroupOutcome

__all__ = ["AgentSnapshot", "record_agent", "record_incident", "record_started", "record_workers"]


@dataclass(frozen=True, slots=True)
class AgentSnapshot:
    """What torch's status events say about the agent, as it was when the event happened."""

    run_id: str
    rdzv_backend: str
    role: str
    entry_point: str  # WorkerSpec.get_entrypoint_name()
    group_rank: int | None
    group_world_size: int | None
    workers: tuple[Worker, ...]
    agent_restarts: int  # the failure restarts so far (torch's remaining_restarts counts down from max_restarts)
    total_run_time: int  # whole seconds since the agent started


def _metadata(
    snapshot: AgentSnapshot,
    state: str,
    worker: Worker | None = None,
    *,
    raw_error: str | None = None,
    duration_ms: float | None = None,
    exit_code: int | None = None,
    worker_pid: int | None = None,
) -> dict[str, EventMetadataValue]:
    inner: dict[str, object] = {"group_world_size": snapshot.group_world_size, "entry_point": snapshot.entry_point}
    if worker is not None:
        inner.update(
            local_rank=[worker.local_rank],
            role_rank=[worker.role_rank],
            role_world_size=[worker.role_world_size],
            exit_code=[exit_code],
            worker_pid=[worker_pid],
        )
    log = events.active()
    return {
        "run_id": snapshot.run_id,
        "global_rank": None if worker is None else worker.global_rank,
        "group_rank": snapshot.group_rank,
        "worker_id": None if worker is None or worker.id is None else str(worker.id),
        "role": snapshot.role,
        "hostname": None if log is None else log.hostname,
        "state": state,
        "total_run_time": snapshot.total_run_time,
        "rdzv_backend": snapshot.rdzv_backend,
        "raw_error": raw_error,
        "metadata": json.dumps(inner),
        "agent_restarts": snapshot.agent_restarts,
        "duration_ms": duration_ms,
    }


def record_agent(
    snapshot: AgentSnapshot, state: str, *, duration_ms: float | None = None, raw_error: str | None = None
) -> None:
    """torch's agent-level event; ``raw_error``: a failed job's root cause, as JSON (aelastic's)."""
    if events.active() is not None:
        metadata = _metadata(snapshot, state, duration_ms=duration_ms, raw_error=raw_error)
        events.record(f"torchelastic.worker.status.{state}", EventSource.AGENT, metadata)


def record_started(snapshot: AgentSnapshot) -> None:
    """torch's per-worker START, recorded once the attempt's workers are spawned: ``worker_id`` is the pid (as a
    string) and the inner ``worker_pid`` is ``[null]``, as torch's ``_initialize_workers`` records it."""
    if events.active() is not None:
        for worker in snapshot.workers:
            events.record("torchelastic.worker.status.START", EventSource.WORKER, _metadata(snapshot, "START", worker))


def record_workers(snapshot: AgentSnapshot, outcome: GroupOutcome) -> None:
    """One event per worker of an attempt that ended: SUCCEEDED, FAILED (exited non-zero by itself) or TERMINATED
    (stopped by the agent because a peer failed), as torch's ``_get_worker_state``."""
    if events.active() is None:
        return
    exits = {e.local_rank: e for e in outcome.exits}
    first = outcome.first_failure
    for worker in snapshot.workers:
        exit = exits.get(worker.local_rank)
        if exit is None or not exit.failed:
            state = "SUCCEEDED" if outcome.succeeded else "TERMINATED"
        else:
            state = "FAILED" if first is not None and exit.local_rank == first.local_rank else "TERMINATED"
        metadata = _metadata(
            snapshot,
            state,
            worker,
            raw_error=None if exit is None or not exit.failed else json.dumps({"exitcode": exit.exitcode}),
            exit_code=None if exit is None else exit.exitcode,
            worker_pid=None if exit is None else exit.pid,
        )
        events.record(f"torchelastic.worker.status.{state}", EventSource.WORKER, metadata)


def record_incident(snapshot: AgentSnapshot, incident: Incident) -> None:
    """``aelastic.incident``: one fault's cost on this node, in torch's agent-event schema with ``state``
    ``INCIDENT``, ``duration_ms`` the time lost, and the incident's fields (its cause, each phase's seconds as
    ``<phase>_s``, how the workers started, what was restored, the steps redone) beside torch's keys."""
    if events.active() is not None:
        metadata = _metadata(snapshot, "INCIDENT", duration_ms=incident.lost * 1000)
        metadata.update(incident.to_json())
        events.record("aelastic.incident", EventSource.AGENT, metadata)
