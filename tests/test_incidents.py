"""Incident records: what a fault cost, phase by phase (the pure ledger, the metrics), and a real 2-node job whose
worker is killed, its agents' figures checked against the lost time the workers' own step logs show."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import test_agent_e2e
from test_agent_e2e import Job, c10d, common, free_port

from aelastic.agent.figures import AgentMetrics
from aelastic.agent.incidents.ledger import PHASES, Incident, Ledger, summary
from aelastic.agent.incidents.parent import Incidents
from benchmarks.steplog import lost_to_the_fault, read

job = test_agent_e2e.job
rendezvous_store = test_agent_e2e.rendezvous_store


# --- the ledger (pure) -----------------------------------------------------------------------------------------------


def steps(ledger: Ledger, first: int, last: int, start: float, each: float, ranks: int = 2) -> float:
    """Every local rank completes steps ``first..last``, one each ``each`` seconds from ``start``; the last time."""
    at = start
    for step in range(first, last + 1):
        at += each
        for rank in range(ranks):
            assert ledger.step(rank, step, at) is None
    return at


def test_a_fault_in_a_step_costs_the_step_the_recovery_and_the_redone_steps_phase_by_phase() -> None:
    ledger = Ledger(local_ranks=2)
    last = steps(ledger, 0, 9, start=100.0, each=1.0)  # step 9 done at 110
    ledger.fault("worker rank 1 failed (exitcode -9)", "failure", fault=110.4, notice=110.4)
    ledger.stopped(110.5)
    ledger.rendezvous_done(110.8)
    assert ledger.started(110.9, "pre-warmed") is None
    ledger.restore_began(111.3)
    ledger.restored(111.4, 8, "memory")  # the job restores step 8: step 9 is redone
    ledger.restored(111.5, 8, "memory")  # the other local rank's end ends the phase
    assert ledger.step(0, 9, 112.5) is None
    assert ledger.step(1, 9, 112.5) is None
    assert ledger.step(0, 10, 113.5) is None
    incident = ledger.step(1, 10, 113.6)  # step 10 done on the node: the job is back, one ordinary step later
    assert incident is not None
    assert incident.complete
    assert incident.phases == pytest.approx(
        {"detection": 0.0, "stop": 0.1, "rendezvous": 0.3, "start": 0.5, "restore": 0.2, "redone": 0.4 + 1.1}
    )
    assert incident.lost == pytest.approx(113.6 - 1.0 - last)  # the step log's own measure
    assert (incident.redone_steps, incident.restored, incident.start) == (1, "step 8 from memory", "pre-warmed")
    assert incident.describe().startswith("incident 1 (worker rank 1 failed (exitcode -9)): 2.600 s lost: ")
    assert "restore 0.200 s (step 8 from memory)" in incident.describe()


def test_a_step_the_failed_attempt_finishes_before_it_is_stopped_changes_no_phase() -> None:
    """A survivor rank of the failed attempt may commit one more step between the fault and its stop (seen with DCP on
    two nodes): that step is thrown away, and must not end the start or the restore before they began."""
    ledger = Ledger(local_ranks=2)
    last = steps(ledger, 0, 9, start=100.0, each=1.0)
    ledger.fault("worker rank 1 failed (exitcode 1)", "failure", fault=110.4, notice=110.4)
    assert ledger.step(0, 10, 110.6) is None  # rank 0 had not heard yet
    assert ledger.step(1, 10, 110.6) is None
    ledger.stopped(110.7)
    ledger.rendezvous_done(110.8)
    assert ledger.started(111.8, "cold") is None
    ledger.restore_began(111.9)
    ledger.restored(112.2, 9, "memory")
    ledger.restored(112.3, 9, "memory")
    assert ledger.step(0, 10, 113.3) is None
    incident = ledger.step(1, 10, 113.3)  # step 10 done again: the job is back
    assert incident is not None
    assert incident.phases["start"] == pytest.approx(1.1)
    assert incident.phases["restore"] == pytest.approx(0.4)
    assert incident.lost == pytest.approx(113.3 - 1.0 - last)


def test_a_fault_learned_from_the_rendezvous_counts_from_the_last_step_as_detection() -> None:
    ledger = Ledger(local_ranks=1)
    last = steps(ledger, 0, 4, start=0.0, each=0.5, ranks=1)
    ledger.fault("membership change: node 1 left", "membership", fault=last, notice=last + 3.0)  # a heartbeat late
    ledger.stopped(last + 3.2)
    ledger.rendezvous_done(last + 3.5)
    ledger.started(last + 3.6, "survivors")
    incident = steps_until_back(ledger, first=5, start=last + 3.6, each=0.5)
    assert incident.phases["detection"] == pytest.approx(3.0)
    # Nothing restored, and the first step is the one after the last: its time, ordinary work, is not lost.
    assert incident.phases["start"] == pytest.approx(0.1)
    assert incident.lost == pytest.approx(3.6)
    assert incident.phases["restore"] == 0
    assert incident.restored is None
    assert incident.redone_steps == 0


def steps_until_back(ledger: Ledger, first: int, start: float, each: float) -> Any:
    at = start
    for step in range(first, first + 10):
        at += each
        incident = ledger.step(0, step, at)
        if incident is not None:
            return incident
    raise AssertionError("the incident never ended")


def test_without_step_marks_an_incident_ends_when_its_workers_start() -> None:
    ledger = Ledger(local_ranks=1)
    ledger.fault("worker rank 0 failed (exitcode 1)", "failure", fault=10.0, notice=10.0)
    ledger.stopped(10.2)
    ledger.rendezvous_done(10.5)
    incident = ledger.started(11.0, "cold")
    assert incident is not None
    assert incident.redone_steps is None
    assert incident.phases == pytest.approx(
        {"detection": 0, "stop": 0.2, "rendezvous": 0.3, "start": 0.5, "restore": 0, "redone": 0}
    )


def test_marks_a_rank_never_completes_are_forgotten_beyond_a_bound() -> None:
    ledger = Ledger(local_ranks=2)
    for step in range(10_000):  # only local rank 0 marks: no step completes, and the agent keeps a bounded few
        assert ledger.step(0, step, float(step)) is None
    assert len(ledger._marks) <= 65


def test_a_second_fault_during_the_recovery_cuts_the_first_incident_and_no_second_counts_twice() -> None:
    ledger = Ledger(local_ranks=1)
    steps(ledger, 0, 3, start=0.0, each=1.0, ranks=1)
    ledger.fault("worker rank 0 failed (exitcode 1)", "failure", fault=4.5, notice=4.5)
    ledger.stopped(4.6)
    cut = ledger.fault("membership change: node 1 left", "membership", fault=5.0, notice=5.0)
    assert cut is not None
    assert not cut.complete
    assert cut.lost == pytest.approx(5.0 - 4.0)
    ledger.stopped(5.1)
    ledger.rendezvous_done(5.2)
    ledger.started(5.3, "cold")
    assert ledger.close(6.0) is not None
    first, second = ledger.incidents
    assert first.lost + second.lost == pytest.approx(6.0 - 4.0)  # contiguous: nothing counted twice
    line = summary(ledger.incidents, total=200.0)
    assert line is not None
    assert line.startswith("2 incidents (1 failure, 1 membership) cost 2.000 s of 200 s (goodput 99.00 %)")
    assert summary([], total=200.0) is None


def test_a_worker_killed_as_hung_is_a_hang_whose_detection_runs_from_its_last_progress() -> None:
    ended: list[Incident] = []
    now = time.monotonic()
    incidents = Incidents(1, ended.append, started_at=now - 10.0)
    incidents.marked(0, 0, at=now - 6.5)
    incidents.marked(0, 1, at=now - 6.0)  # then rank 0 made no progress: the hang's verdict 5 s after it went idle
    incidents.hung(idle=5.0)
    incidents.fault("worker rank 0 failed (exitcode -9)", "failure", notice=now, seen=True)
    incidents.stopped(now + 0.1)
    incidents.rendezvous_done()
    incidents.started("cold")
    incidents.marked(0, 2, at=now + 1.0)  # an ordinary step (0.5 s) after the start
    (incident,) = ended
    assert (incident.kind, incident.cause) == ("hang", "worker rank 0 failed (exitcode -9), killed as hung")
    assert incident.phases["detection"] == pytest.approx(5.0, abs=0.05)
    assert incident.phases["redone"] == pytest.approx(1.0, abs=0.05)  # the second before it went idle


def test_the_metrics_endpoint_has_each_phase_the_causes_and_the_goodput() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from aelastic.agent.control import _registry

    ledger = Ledger(local_ranks=1)
    ledger.fault("worker rank 0 failed (exitcode 1)", "failure", fault=1.0, notice=1.0)
    ledger.stopped(1.5)
    metrics = AgentMetrics("default", 3)
    metrics.incident(ledger.started(2.0, "cold"))  # type: ignore[arg-type]
    text = generate_latest(_registry(metrics)).decode()
    assert 'aelastic_incident_phase_seconds_bucket{le="0.5",phase="stop",role="default"} 1.0' in text, text
    assert 'aelastic_incident_phase_seconds_sum{phase="rendezvous",role="default"} 0.5' in text
    assert 'aelastic_incidents_total{cause="failure",role="default"} 1.0' in text
    assert 'aelastic_incidents_total{cause="membership",role="default"} 0.0' in text
    assert 'aelastic_incident_lost_seconds_total{role="default"} 1.0' in text
    goodput = float(re.search(r'aelastic_goodput_ratio\{role="default"\} (\S+)', text)[1])  # type: ignore[index]
    assert goodput < 1.0


# --- a real job ------------------------------------------------------------------------------------------------------

MARKS = """
import aelastic.worker
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(12):  # no checkpoint: a restart begins again at step 0
    time.sleep(0.05)
    if attempt == 0 and step == 8:
        raise RuntimeError("a fault at step 8")
    aelastic.worker.step(step)
aelastic.worker.step(-1)
"""


async def test_step_marks_count_the_steps_a_restart_without_a_checkpoint_does_again(job: Job) -> None:
    script = job.script("marks.py", MARKS)
    agent = await job.agent("--standalone", *common(1, "--max-restarts", "1"), script, job.out)
    assert await agent.wait() == 1, agent.output  # the last mark's bad step is the script's error, after the incident
    line = re.search(r"incident 1 \(worker rank 0 failed \(exitcode 1\)\): (\S+) s lost: .*start \S+ s \(cold\), "
                     r"restore 0\.000 s, redone (\S+) s \(8 steps\)", agent.output)  # fmt: skip
    assert line is not None, agent.output
    assert float(line[2]) >= 8 * 0.05, line[0]  # steps 0-7 again
    assert "aelastic.worker.step: n=-1: must be an int >= 0" in agent.output, agent.output


TRAIN = """
import signal
import torch
import torch.distributed
import aelastic.checkpoint as ckpt

def main():
    steps, fault_step, pause = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    dist = init_gloo()
    rank = dist.get_rank()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) + int(os.environ["AELASTIC_MEMBERSHIP_RESTARTS"])
    state = {"w": torch.zeros(4), "step": -1}
    restored = ckpt.load(into=state)
    start = 0 if restored is None else restored["step"] + 1
    log = open(os.path.join(OUT, f"steps-{os.getppid()}.log"), "a")  # one per agent
    for step in range(start, steps):
        t = torch.ones(4)
        dist.all_reduce(t)
        state["w"] += t
        time.sleep(pause)
        if attempt == 0 and rank == 1 and step == fault_step:
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.save({"w": state["w"], "step": step}, step=step)
        print(json.dumps({"step": step, "at": time.monotonic(), "round": attempt}), file=log, flush=True)
    report("done")
    while not os.path.exists(os.path.join(OUT, "go")):  # the test reads the agents' /metrics meanwhile
        time.sleep(0.05)
    dist.destroy_process_group()

main()
"""


async def test_a_killed_worker_s_incident_adds_up_to_the_time_its_step_log_lost_on_every_node(
    job: Job, rendezvous_store: str, tmp_path: Path
) -> None:
    fault = random.Random().randrange(8, 16)
    print("the fault's step:", fault)
    script = job.script("train.py", TRAIN)
    agents, ports = [], []
    for node in range(2):
        logs, port = tmp_path / f"logs{node}", free_port()
        flags = [*c10d(rendezvous_store, "2"), *common(1, "--max-restarts", "1", "--prewarm"),
                 "--event-log-handler", "file", "--log-dir", str(logs), "--metrics-port", str(port)]  # fmt: skip
        agents.append(await job.agent(*flags, script, job.out, "30", str(fault), "0.1"))
        ports.append(port)
    await job.wait_records("done", 2)  # both workers trained every step: each node's incident has ended
    async with httpx.AsyncClient() as http:
        pages = [(await http.get(f"http://127.0.0.1:{port}/metrics")).text for port in ports]
    (job.out / "go").touch()
    for agent in agents:
        assert await agent.wait(test_agent_e2e.DEADLINE + 30) == 0, agent.output
    causes = []
    for node, agent in enumerate(agents):
        outside = lost_to_the_fault(read(job.out / f"steps-{agent.process.pid}.log"))
        line = re.search(r"incident 1 \((.+)\): (\d+\.\d+) s lost: (.*)", agent.output)
        assert line is not None, agent.output
        lost = float(line[2])
        assert abs(lost - outside) <= max(0.1 * outside, 0.05), (node, lost, outside, line[0])
        phases = dict(re.findall(r"(\w+) (\d+\.\d+) s", line[3]))
        assert list(phases) == list(PHASES), line[0]
        assert sum(map(float, phases.values())) == pytest.approx(lost, abs=0.005)
        assert "(pre-warmed)" in line[3], line[0]
        assert "from memory)" in line[3], line[0]
        ended = re.search(r"1 incident \(1 (failure|membership)\) cost (\d+\.\d+) s of .*goodput (\S+) %", agent.output)
        assert ended is not None, agent.output
        assert float(ended[2]) == lost, agent.output
        events = [
            json.loads(e) for e in next((tmp_path / f"logs{node}").rglob("events.jsonl")).read_text().splitlines()
        ]
        (incident,) = [e["metadata"] for e in events if e["name"] == "aelastic.incident"]
        assert incident["state"] == "INCIDENT"
        assert incident["lost_s"] == pytest.approx(lost, abs=0.0006)
        assert sum(incident[f"{p}_s"] for p in PHASES) == pytest.approx(incident["lost_s"], abs=1e-5)
        # The restore (a few kilobytes) may end less than an ordinary step before the job is back: 0 then.
        assert incident["rendezvous_s"] > 0, line[0]
        assert incident["start_s"] > 0, line[0]
        assert incident["restore_s"] >= 0, line[0]
        causes.append(line[1])
        scraped = re.search(r'aelastic_incident_lost_seconds_total\{role="default"\} (\S+)', pages[node])
        assert scraped is not None, pages[node]
        assert float(scraped[1]) == pytest.approx(lost, abs=0.0006), pages[node]
        for phase in PHASES:
            series = rf'aelastic_incident_phase_seconds_sum{{phase="{phase}",role="default"}} (\S+)'
            assert float(re.search(series, pages[node])[1]) == pytest.approx(incident[f"{phase}_s"], abs=1e-5)  # type: ignore[index]
        print(f"node {node}: {line[0]}; the step log says {outside:.3f} s")
    # The other node hears of the loss from the rendezvous, or first from its own worker's failed collective.
    assert "worker rank 1 failed (exitcode -9)" in causes, causes
    assert any(c.startswith(("membership change", "worker rank 0 failed")) for c in causes), causes
    argv = [sys.executable, "-m", "aelastic", "status", "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous_store,
            "--rdzv-id", "e2e"]  # fmt: skip
    with anyio.fail_after(test_agent_e2e.DEADLINE):
        result = await anyio.run_process(argv, check=False)  # the store is served by this test's event loop
    shown = subprocess.CompletedProcess(argv, result.returncode, result.stdout.decode(), result.stderr.decode())
    assert shown.returncode == 0, shown.stderr
    last = re.search(r"last incident \(node \d \(.+\)\): incident 1 \((.+)\): \d+\.\d+ s lost", shown.stdout)
    assert last is not None, shown.stdout
    assert last[1] in causes, shown.stdout
    assert "that node so far: 1 incident (1 " in shown.stdout, shown.stdout
