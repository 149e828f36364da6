"""torch's ``torchelastic.worker.status.<STATE>`` events for the agent's transitions (``aelastic.events``).

The metadata is torch's ``SimpleElasticAgent._construct_event``, key for key: top-level ``run_id, global_rank,
group_rank, worker_id, role, hostname, state, total_run_time, rdzv_backend, raw_error, metadata, agent_restarts,
duration_ms``, with ``metadata`` a JSON *string* holding ``group_world_size`` and ``entry_point`` and, for worker
events, one-element lists ``local_rank, role_rank, role_world_size, exit_code, worker_pid``. Everything is built
only when an event log is active.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from .. import events
from ..events import EventMetadataValue, EventSource

if TYPE_CHECKING:
    from .agent import ElasticAgent, Worker
    from .processes import GroupOutcome

__all__ = ["record_agent", "record_started", "record_workers"]


def _metadata(
    agent: ElasticAgent,
    state: str,
    worker: Worker | None = None,
    *,
    raw_error: str | None = None,
    duration_ms: float | None = None,
    exit_code: int | None = None,
    worker_pid: int | None = None,
) -> dict[str, EventMetadataValue]:
    g, spec = agent.group, agent.spec
    inner: dict[str, object] = {"group_world_size": g.group_world_size, "entry_point": spec.get_entrypoint_name()}
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
        "run_id": agent.handler.get_run_id(),
        "global_rank": None if worker is None else worker.global_rank,
        "group_rank": g.group_rank,
        "worker_id": None if worker is None or worker.id is None else str(worker.id),
        "role": spec.role,
        "hostname": None if log is None else log.hostname,
        "state": state,
        "total_run_time": int(time.monotonic() - agent.started_at),
        "rdzv_backend": agent.handler.get_backend(),
        "raw_error": raw_error,
        "metadata": json.dumps(inner),
        "agent_restarts": agent.failure_restarts,
        "duration_ms": duration_ms,
    }


def record_agent(agent: ElasticAgent, state: str, *, duration_ms: float | None = None) -> None:
    if events.active() is not None:
        metadata = _metadata(agent, state, duration_ms=duration_ms)
        events.record(f"torchelastic.worker.status.{state}", EventSource.AGENT, metadata)


def record_started(agent: ElasticAgent) -> None:
    """torch's per-worker START, recorded once the attempt's workers are spawned: ``worker_id`` is the pid (as a
    string) and the inner ``worker_pid`` is ``[null]``, as torch's ``_initialize_workers`` records it."""
    if events.active() is not None:
        for worker in agent.group.workers:
            events.record("torchelastic.worker.status.START", EventSource.WORKER, _metadata(agent, "START", worker))


def record_workers(agent: ElasticAgent, outcome: GroupOutcome) -> None:
    """One event per worker of an attempt that ended: SUCCEEDED, FAILED (exited non-zero by itself) or TERMINATED
    (stopped by the agent because a peer failed), as torch's ``_get_worker_state``."""
    if events.active() is None:
        return
    exits = {e.local_rank: e for e in outcome.exits}
    first = outcome.first_failure
    for worker in agent.group.workers:
        exit = exits.get(worker.local_rank)
        if exit is None or not exit.failed:
            state = "SUCCEEDED" if outcome.succeeded else "TERMINATED"
        else:
            state = "FAILED" if first is not None and exit.local_rank == first.local_rank else "TERMINATED"
        metadata = _metadata(
            agent,
            state,
            worker,
            raw_error=None if exit is None or not exit.failed else json.dumps({"exitcode": exit.exitcode}),
            exit_code=None if exit is None else exit.exitcode,
            worker_pid=None if exit is None else exit.pid,
        )
        events.record(f"torchelastic.worker.status.{state}", EventSource.WORKER, metadata)
