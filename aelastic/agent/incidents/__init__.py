"""Incident records: what each fault cost the job, phase by phase, and its goodput.

The pure part is :mod:`.ledger` (an incident's phases from the times the agent saw); :mod:`.parent` is the agent's
side: the ledger fed by the agent's recorder (faults, stops, rounds, starts), by the checkpoint keeper (saves and
restores) and by the workers' own marks over their links (the ``progress`` service: ``aelastic.worker.step(n)``,
``aelastic.worker.busy(what)``). The worker side is :mod:`aelastic.worker._progress`. Each incident is logged,
recorded as an ``aelastic.incident`` event and counted in ``/metrics``; the job's end logs one summary line on
every node.
"""

from typing import Final

# In the job's store (RendezvousInfo.job_store): the last incident that ended on any node, for aelastic status.
INCIDENT_KEY: Final = "aelastic/last_incident"
