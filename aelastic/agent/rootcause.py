"""The job's root cause: every node's failures in one place, in the order the store saw them, and the one failure
every node names.

torch's failure report picks a root cause per node, by its own workers' timestamps: on a multi-node job each node
names its own first failure, often a victim (a rank whose collective failed because a peer on another node died).
Here, when an attempt ends, every node that saw a worker fail publishes its failures to the round's store, each
numbered by the store's counter (``add``: the store's order, no host's clock), and a classification of each:

* ``failed``: the worker's own failure (an exception of its code, a crash, a signal from outside, a hang's verdict);
* ``victim``: its error is a collective's or the store's after a peer went away (gloo's "Connection closed by
  peer", NCCL's errors, ...), as :func:`~aelastic.worker._restart.is_distributed_error` tells them in a worker;
* ``stopped``: the agent stopped it because the attempt ended (SIGTERM, or SIGKILL after the grace).

The job's root cause is the first ``failed`` record in the store's order, else the first record. A node that ends
the job reads every node's records (waiting a bounded time for nodes still writing) before it reports, so every
node's report names the same one. The last root cause of a round is kept under ``aelastic/root_cause`` in the round's
store, where ``aelastic status`` reads it.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Final

import anyio

from ..errors import StoreError
from ..store.api import Store
from ..worker._restart import PEER_FAILURE_MARKERS
from .errors import NOT_AVAILABLE, ProcessFailure

__all__ = [
    "CAUSE_KEY",
    "FailureRecord",
    "JobFailures",
    "as_reported",
    "error_line",
    "first_cause",
    "kind_of",
    "with_cause",
]

logger = logging.getLogger(__name__)

_PREFIX: Final = "aelastic/failures"
CAUSE_KEY: Final = "aelastic/root_cause"  # in the round's store: the job's root cause, for aelastic status
_MAX_ERROR_DATA: Final = 64 << 10  # an error file's JSON travels with its record up to this size
_WRITING: Final = 1.0  # seconds a record numbered by another node may take to be written


def error_line(failure: ProcessFailure) -> str:
    """The exception's line: the error file's message, or the last line the worker wrote to stderr (not the whole
    traceback: its frames' paths name torch.distributed's modules whatever failed)."""
    if failure.error_file != NOT_AVAILABLE:
        return failure.message
    lines = [line.strip() for line in failure.traceback.splitlines() if line.strip()]
    return lines[-1] if lines else failure.message


def kind_of(failure: ProcessFailure, *, stopped: bool) -> str:
    """``victim`` (a collective's error after a peer's loss, whether or not the agent's stop then ended it),
    ``stopped`` (by the agent) or ``failed``."""
    if any(marker in error_line(failure) for marker in PEER_FAILURE_MARKERS):
        return "victim"
    return "stopped" if stopped else "failed"


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """One failed worker as the job knows it."""

    seq: int  # the store's order
    node: int  # its node's rank in the round
    host: str
    kind: str  # failed, victim, stopped
    failure: ProcessFailure

    def to_json(self) -> dict[str, Any]:
        failure = asdict(self.failure)
        if len(json.dumps(failure["error_data"])) > _MAX_ERROR_DATA:
            failure["error_data"] = {}
        return {"seq": self.seq, "node": self.node, "host": self.host, "kind": self.kind, "failure": failure}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FailureRecord:
        return cls(int(data["seq"]), int(data["node"]), str(data["host"]), str(data["kind"]),
                   ProcessFailure(**data["failure"]))  # fmt: skip

    def describe(self) -> str:
        """One line: who failed, where, how."""
        how = f"exitcode {self.failure.exitcode}"
        if self.failure.signal_name() != NOT_AVAILABLE:
            how += f" ({self.failure.signal_name()})"
        return f"rank {self.failure.global_rank} on node {self.node} ({self.host}): {how}: {self.failure.message}"


def as_reported(record: FailureRecord) -> ProcessFailure:
    """A record's failure as another node's report shows it: its host says which node."""
    return replace(record.failure, host=f"{record.host} (node {record.node})")


def first_cause(records: Iterable[FailureRecord]) -> FailureRecord | None:
    """The job's root cause: the first ``failed`` record in the store's order, else the first record."""
    ordered = sorted(records, key=lambda record: record.seq)
    return next((r for r in ordered if r.kind == "failed"), ordered[0] if ordered else None)


def with_cause(failure: ProcessFailure, kind: str, cause: FailureRecord | None) -> ProcessFailure:
    """``failure`` with a line saying what it is, when it is not the root cause (ends its traceback field)."""
    if cause is None or (cause.failure.global_rank == failure.global_rank and cause.failure.pid == failure.pid):
        return failure
    what = {"victim": "a victim: its collective failed after", "stopped": "stopped by its agent after"}.get(kind)
    if what is None:
        what = "failed too, after"
    line = f"aelastic: {what} the job's root cause, rank {cause.failure.global_rank} on node {cause.node}"
    return replace(failure, traceback=f"{failure.traceback}\n  {line}")


class JobFailures:
    """One round's failure records in its store (see the module doc).

    Args:
        store: the round's store; ``node``/``nodes``: this node's rank in the round and the round's size.
    """

    def __init__(self, store: Store, node: int, nodes: int) -> None:
        self.store = store.prefixed(_PREFIX)
        self.round_store = store
        self.node, self.nodes = node, nodes
        self.host = socket.gethostname()

    def __repr__(self) -> str:
        return f"<JobFailures node={self.node}/{self.nodes}>"

    async def publish(self, failures: Sequence[tuple[ProcessFailure, str]]) -> None:
        """Publish this node's failures of the attempt (each with its kind), then say this node is done."""
        try:
            for failure, kind in failures:
                seq = await self.store.add("seq", 1)
                record = FailureRecord(seq, self.node, self.host, kind, failure)
                await self.store.set(f"record/{seq}", json.dumps(record.to_json()).encode())
            await self.store.set(f"done/{self.node}", b"")
        except StoreError as exc:  # the round's store is gone (its host too): the report stays this node's
            logger.warning("could not publish this node's failures to the job: %s", exc)

    async def collect(self, wait: float) -> list[FailureRecord]:
        """Every record published so far, and the job's root cause kept for ``aelastic status``. When the first
        record is no worker's own failure, a node still writing may hold the cause: this waits up to ``wait``
        seconds for every node to be done, then reads again."""
        try:
            records = await self._read()
            cause = first_cause(records)
            if cause is None or cause.kind != "failed":
                with anyio.move_on_after(wait):
                    await self.store.wait([f"done/{node}" for node in range(self.nodes)])
                records = await self._read()
                cause = first_cause(records)
            if cause is not None:
                await self.round_store.compare_set(CAUSE_KEY, b"", json.dumps(cause.to_json()).encode())
        except StoreError as exc:  # the round's store is gone: the report stays this node's
            logger.warning("could not read the job's failures: %s", exc)
            return []
        return records

    async def _read(self) -> list[FailureRecord]:
        count = await self.store.add("seq", 0)
        keys = [f"record/{seq}" for seq in range(1, count + 1)]
        with anyio.move_on_after(_WRITING):  # numbered by a node that writes it now (a store round trip away)
            await self.store.wait(keys)
        return [
            FailureRecord.from_json(json.loads(await self.store.get(k))) for k in keys if await self.store.check([k])
        ]
