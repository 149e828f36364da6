"""The pure part of hang detection (see :mod:`aelastic.agent.hang`): whether a worker made progress, and which ranks
of a job that made none are the odd ones out. No I/O and no clock: the caller passes the samples and the times."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

__all__ = ["Progress", "RankReport", "Verdict", "judge", "span"]

# A worker that used less than this share of one CPU between two samples made no progress in between: a rank
# blocked in a collective, a sleep or a lock uses none, but torch's and the runtime's threads wake now and then.
# Judged per interval, not since the last progress: a rank idle for a while that works again counts at once.
IDLE_SHARE: Final = 0.02
MIN_MOVE: Final = 0.02  # seconds of CPU that count as progress in any interval (two ticks of the kernel's 100 Hz)
# Bytes moved through read and write calls count as progress too, at this rate or more: a rank writing a checkpoint
# to slow storage, its CPU nearly idle, moves megabytes a second; a rank blocked in a collective moves none, and a
# hung one's stray log lines and heartbeats move bytes, not tens of kilobytes, a second.
IO_RATE: Final = 64 << 10
_STATES: Final = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible sleep (D state)",
    "T": "stopped (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "exited, not reaped",
    "": "gone",
}
# A state that explains a hang by itself, whatever the stack says.
_STUCK_STATES: Final = frozenset("DTtZ")
# '    all_reduce (torch/distributed/distributed_c10d.py:2950)', as py-spy and the fallback write a frame.
_COLLECTIVE: Final = re.compile(r"^\s*([\w<>.]+) \([^)]*distributed_c10d\.py:\d+\)")


class Progress:
    """Each worker's CPU time and bytes moved, sampled, and since when it has made no progress (:data:`IDLE_SHARE`,
    :data:`IO_RATE`)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, int, float]] = {}  # pid -> (CPU seconds, bytes, time) of its last sample
        self._since: dict[int, float] = {}  # pid -> when it last made progress (or was first sampled)

    def observe(self, pid: int, cpu: float, now: float, io: int = 0, *, busy: bool = False) -> None:
        """A sample of ``pid``'s CPU seconds and bytes moved at ``now``; ``busy``: the worker said it is busy
        (``aelastic.worker.busy``), which counts as progress whatever its process shows."""
        last = self._last.get(pid)
        if (
            busy
            or last is None
            or cpu - last[0] >= max(MIN_MOVE, IDLE_SHARE * (now - last[2]))
            or io - last[1] >= max(1, IO_RATE * (now - last[2]))
        ):
            self._since[pid] = now
        self._last[pid] = (cpu, io, now)

    def idle_for(self, pids: Iterable[int], now: float) -> float:
        """The least time any of ``pids`` has gone without progress (0 for one never sampled)."""
        return min((now - self._since[pid] if pid in self._since else 0.0 for pid in pids), default=0.0)

    def forget(self, pids: Iterable[int]) -> None:
        """Drop workers that ended."""
        for pid in pids:
            self._last.pop(pid, None)
            self._since.pop(pid, None)


@dataclass(frozen=True, slots=True)
class RankReport:
    """What one node saw of one of its workers once the job was found hung."""

    rank: int
    node: int  # the node's group rank
    host: str
    pid: int
    state: str  # the /proc state letter
    frames: tuple[str, ...]  # the main thread's, innermost first: 'function (file:line)'

    @property
    def collective(self) -> str | None:
        """The torch.distributed call the worker is in (``all_reduce``, ``barrier``, ...), if any."""
        for frame in self.frames:
            match = _COLLECTIVE.match(frame)
            if match:
                return match.group(1)
        return None

    def describe(self) -> str:
        """One line: where the worker is and in what state."""
        where = f"in {self.collective}" if self.collective else "outside any collective"
        top = f", at {self.frames[0]}" if self.frames else ""
        state = _STATES.get(self.state, self.state)
        return f"rank {self.rank} (node {self.node}, {self.host}, pid {self.pid}): {state}, {where}{top}"

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "node": self.node, "host": self.host, "pid": self.pid, "state": self.state,
                "frames": list(self.frames)}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> RankReport:
        frames = data.get("frames")
        return cls(int(str(data["rank"])), int(str(data["node"])), str(data["host"]), int(str(data["pid"])),
                   str(data["state"]), tuple(str(f) for f in frames) if isinstance(frames, list) else ())  # fmt: skip


class Verdict(NamedTuple):
    """Which ranks a hung job names, whether every worker must go (the named ones cannot all be killed by their
    agents, or the job hangs as a whole), and what the report says."""

    culprits: frozenset[int]
    everyone: bool
    summary: str


def span(ranks: Iterable[int]) -> str:
    """``ranks`` in short: 'rank 3', 'ranks 0-2, 5'."""
    ordered = sorted(set(ranks))
    runs: list[tuple[int, int]] = []
    for rank in ordered:
        if runs and runs[-1][1] == rank - 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ordered) == 1 else "ranks ") + text


def judge(reports: Sequence[RankReport], world_size: int) -> Verdict:
    """The odd ones out of a job where no rank made progress.

    In order: ranks in a state that explains a hang by itself (stopped, uninterruptible, exited); else, when some
    ranks wait in a collective, those that are in none (the collective waits for them) and those whose agents did
    not report (they may be the ones waited for); else, when the ranks wait in different collectives, those not in
    the most common one; else every rank: they hang alike (a collective that never completes, a deadlock), and
    nothing tells one from another. Every worker must go when a named rank has no report (no agent answered for
    it) or when every rank is named.
    """
    by_rank = {report.rank: report for report in reports}
    missing = {rank for rank in range(world_size) if rank not in by_rank}
    culprits = {r.rank for r in reports if r.state in _STUCK_STATES}
    why = "its process state"
    if not culprits:
        waiting = {r.rank for r in reports if r.collective is not None}
        if waiting and (len(waiting) < len(reports) or missing):
            culprits = {r.rank for r in reports if r.collective is None} | missing
            why = "the others wait for it in a collective"
        elif waiting:
            counts = Counter(r.collective for r in reports).most_common()
            if len(counts) > 1 and counts[0][1] > counts[1][1]:
                culprits = {r.rank for r in reports if r.collective != counts[0][0]}
                why = f"the others wait in {counts[0][0]}"
    if not culprits:
        culprits, why = set(range(world_size)), "no rank differs from the others: the job hangs as a whole"
    lines = [f"{span(culprits)} named ({why}):"]
    lines += [f"  {by_rank[rank].describe()}" for rank in sorted(culprits - missing)]
    if culprits & missing:
        lines.append(f"  {span(culprits & missing)}: no report (their agents did not answer)")
    others = sorted(set(by_rank) - culprits)
    if others:
        lines.append(f"  the others: {_summarize(by_rank[rank] for rank in others)}")
    everyone = bool(culprits & missing) or len(culprits) == world_size
    return Verdict(frozenset(culprits), everyone, "\n".join(lines))


def _summarize(reports: Iterable[RankReport]) -> str:
    """'ranks 0-2 in all_reduce; rank 5 outside any collective'."""
    groups: dict[str, list[int]] = {}
    for report in reports:
        groups.setdefault(f"in {report.collective}" if report.collective else "outside any collective", []).append(
            report.rank
        )
    return "; ".join(f"{span(ranks)} {where}" for where, ranks in groups.items())
