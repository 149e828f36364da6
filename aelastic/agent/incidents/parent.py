"""The agent's side of incident records (see :mod:`aelastic.agent.incidents`): the node's :class:`Incidents`, a link
service named ``progress``.

Times are ``time.monotonic()``: one clock for every process of the host, so a worker's marks and the agent's own
observations compare directly (never across hosts).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from ...errors import StoreError
from ...store.api import Store
from ..link.parent import LinkRefusal
from ..spawn.parent import WorkerProcess
from . import INCIDENT_KEY
from .ledger import Incident, Ledger, summary

__all__ = ["Incidents"]

logger = logging.getLogger(__name__)


class Incidents:
    """One node's incidents (:class:`~.ledger.Ledger`), fed by the agent and by its workers; ``on_incident`` is
    called with each incident as it ends; the goodput counts from ``started_at``. The workers also say here when
    they are busy in a way that looks like a hang from outside (:meth:`busy`)."""

    name: Final = "progress"

    def __init__(self, local_ranks: int, on_incident: Callable[[Incident], None], started_at: float) -> None:
        self.ledger = Ledger(local_ranks)
        self.on_incident = on_incident
        self.started_at = started_at  # what the goodput counts from (time.monotonic())
        self._busy: dict[int, str] = {}  # pid -> what the worker said it is busy with
        self._hung_since: float | None = None  # a hang was declared: since when no worker made progress
        self._job: tuple[Store, str] | None = None  # the job's store, and who this node is in the round
        self._unpublished: Incident | None = None  # the last incident that ended, until the job's store has it

    def __repr__(self) -> str:
        return f"<Incidents {self.ledger!r} busy={len(self._busy)}>"

    def _ended(self, incident: Incident | None) -> None:
        if incident is not None:
            self._unpublished = incident
            self.on_incident(incident)

    def joined(self, job_store: Store | None, node: str) -> None:
        """A round completed: where its incidents are published (:meth:`publish`), and this node's name in it."""
        self._job = None if job_store is None else (job_store, node)

    async def publish(self) -> None:
        """Put the last incident that ended, with this node's summary so far, in the job's store (once)."""
        incident, self._unpublished = self._unpublished, None
        if incident is None or self._job is None:
            return
        store, node = self._job
        total = summary(self.ledger.incidents, time.monotonic() - self.started_at)
        record = {"node": node, "incident": incident.describe(), "summary": total}
        try:
            await store.set(INCIDENT_KEY, json.dumps(record).encode())
        except StoreError as exc:  # the store is gone or going: the log has the line
            logger.debug("could not publish incident %d: %s", incident.number, exc)

    # --- what the agent saw ------------------------------------------------------------------------------------

    def fault(self, cause: str, kind: str, *, notice: float, seen: bool) -> None:
        """A fault, noticed at ``notice``; ``seen``: the agent saw the fault itself (a local worker's exit), else
        it learned of it from the rendezvous, and the time since the last step is its detection."""
        ledger = self.ledger
        fault = notice if seen else min(notice, ledger.last_step_time(default=notice))
        if seen and self._hung_since is not None:  # the worker was killed as hung: the hang began long before
            cause, kind, fault = f"{cause}, killed as hung", "hang", min(self._hung_since, notice)
        self._hung_since = None
        self._busy.clear()  # a survivor re-enters its training function: whatever it was busy with is over
        self._ended(ledger.fault(cause, kind, fault, notice))

    def hung(self, idle: float) -> None:
        """A hang was declared: no worker made progress for ``idle`` seconds; the failure that follows is its."""
        self._hung_since = time.monotonic() - idle

    def stopped(self, at: float) -> None:
        self.ledger.stopped(at)

    def rendezvous_done(self) -> None:
        self.ledger.rendezvous_done(time.monotonic())

    def started(self, how: str) -> None:
        self._ended(self.ledger.started(time.monotonic(), how))

    def close(self) -> str | None:
        """The run is over: the summary line (``None`` when nothing happened)."""
        now = time.monotonic()
        self._ended(self.ledger.close(now))
        return summary(self.ledger.incidents, now - self.started_at)

    # --- what the checkpoint keeper saw ------------------------------------------------------------------------

    def marked(self, local_rank: int, step: int, at: float | None = None) -> None:
        self._ended(self.ledger.step(local_rank, step, time.monotonic() if at is None else at))

    def restore_began(self) -> None:
        self.ledger.restore_began(time.monotonic())

    def restored(self, step: int, source: str) -> None:
        self.ledger.restored(time.monotonic(), step, source)

    # --- the workers' marks (aelastic.worker.step, aelastic.worker.busy) ---------------------------------------

    def busy(self, pid: int) -> str | None:
        """What worker ``pid`` said it is busy with (``None``: nothing)."""
        return self._busy.get(pid)

    async def handle(
        self, worker: WorkerProcess, op: str, message: Mapping[str, Any]
    ) -> tuple[dict[str, Any], Sequence[int]]:
        if op == "step":
            self.marked(worker.local_rank, int(message["step"]), float(message["at"]))
            await self.publish()
        elif op == "busy":
            what = message.get("what")
            if what is None:
                self._busy.pop(worker.pid, None)
            else:
                self._busy[worker.pid] = str(what)
        else:
            raise LinkRefusal(f"no progress operation {op!r}")
        return {}, ()
