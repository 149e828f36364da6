"""The job's root cause, named alike by every node (issue 31), with torchrun's reports on the same job beside it.

Two hosts, two gloo workers each, ``--max-restarts 0``; global rank 2 raises at step 5 (``raiser.py``, under
torch's ``record``): its peers' all-reduces then fail too ("Connection closed by peer"), each node sees failures,
and torch's rule (each node's earliest timestamp) lets a node name one of its own victims. The rendezvous store is
an ``aelastic store`` on h0 that outlives the job, so that ``aelastic status`` can read it afterwards; each agent
has an error file of its own (``TORCHELASTIC_ERROR_FILE``), as under an outer agent or a scheduler.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import C10D_PORT, Cluster, Proc

pytestmark = [pytest.mark.faults, pytest.mark.torch]

RAISER = Path(__file__).resolve().parent / "raiser.py"
CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,heartbeat_timeout=2,last_call_timeout=1"  # torch: integers


def run_job(cluster: Cluster, launcher: str) -> list[Proc]:
    """The job under ``launcher``, one agent per host, both ended."""
    endpoint = f"{cluster.hosts[0].addr}:{C10D_PORT}"
    command = [sys.executable, "-m", "torch.distributed.run"] if launcher == "torchrun" else [
        sys.executable, "-m", "aelastic", "run", "--event-log-handler", "file"]  # fmt: skip
    agents = [
        cluster.spawn(
            host, *command, "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "0", "--local-addr",
            host.addr, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", launcher, "--rdzv-conf",
            f"{CONF},is_host=0", "--log-dir", host.dir / launcher, RAISER, cluster.out / launcher,
            log=f"{launcher}-agent",
            env={"FAULTS_HOST": host.name, "FAULTS_RAISE_RANK": "2", "FAULTS_RAISE_STEP": "5",
                 "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
                 "TORCHELASTIC_ERROR_FILE": str(host.dir / f"{launcher}-error.json")},
        )
        for host in cluster.hosts[:2]
    ]  # fmt: skip
    for agent in agents:
        agent.wait()
    return agents


def root_cause(output: str) -> str:
    """The report's root-cause section."""
    return output[output.rindex("Root Cause (first observed failure):") :]


def test_every_node_names_the_rank_that_failed_first_and_the_others_as_what_they_are(cluster: Cluster) -> None:
    h0 = cluster.hosts[0]
    store = cluster.spawn(h0, sys.executable, "-m", "aelastic", "store", "--host", h0.addr, "--port", str(C10D_PORT),
                          log="store")  # fmt: skip
    cluster.wait_for("the store listening", lambda: "listening on" in store.output or None)
    torchrun = run_job(cluster, "torchrun")
    for agent in torchrun:  # what torch's reports say of the same job, for the record
        print(f"--- torchrun on {agent.host.name}: rc {agent.popen.returncode}\n{root_cause(agent.output)}")
    agents = run_job(cluster, "aelastic")
    for agent in agents:
        print(f"--- aelastic on {agent.host.name}: rc {agent.popen.returncode}\n{root_cause(agent.output)}")
    hosts = {}
    failed_events: list[dict[str, object]] = []
    for agent in agents:
        assert agent.popen.returncode == 1, agent.output
        cause = root_cause(agent.output)
        assert re.search(r"rank      : 2 \(local_rank: 0\)", cause), cause
        assert "RuntimeError: rank 2 fails at step 5" in cause, cause
        hosts[agent.host.name] = re.search(r"host      : (.+)", cause)[1]  # type: ignore[index]
        report = agent.output[agent.output.rindex("Failures:") : agent.output.rindex("Root Cause")]
        for rank in {0, 1, 3} & {int(r) for r in re.findall(r"rank      : (\d) ", report)}:
            block = report[report.index(f"rank      : {rank} ") :].split("\n[", 1)[0]
            assert re.search(r"aelastic: (a victim: its collective failed|stopped by its agent) after the job's root "
                             r"cause, rank 2 on node \d", block), block  # fmt: skip
        error = json.loads((agent.host.dir / "aelastic-error.json").read_text())
        assert error["message"]["message"] == "RuntimeError: rank 2 fails at step 5", error
        assert error["message"]["errorCode"] == 1
        events = [json.loads(line) for path in (agent.host.dir / "aelastic").glob("*/events.jsonl")
                  for line in path.read_text().splitlines()]  # fmt: skip
        # A node whose run failed records torch's agent FAILED event, naming the job's cause (one whose workers were
        # only stopped ends with FailedElsewhereError instead).
        failed_events += [json.loads(e["metadata"]["raw_error"])["root_cause"] for e in events
                          if e["name"] == "torchelastic.worker.status.FAILED" and e["source"] == "AGENT"]  # fmt: skip
    assert failed_events, "no agent FAILED event"
    assert all((e["rank"], e["message"]) == (2, "RuntimeError: rank 2 fails at step 5") for e in failed_events)
    # The node that ran rank 2 shows its host; the other one says which node that was (the hosts here share one
    # hostname: the namespaces' machine's).
    remote = [host for host in hosts.values() if "(node " in host]
    assert len(remote) == 1, hosts
    status = subprocess.run(
        h0.command(sys.executable, "-m", "aelastic", "status", "--rdzv-endpoint", f"{h0.addr}:{C10D_PORT}",
                   "--rdzv-id", "aelastic", "--json"),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    failure = json.loads(status.stdout)["last_failure"]
    assert failure["rank"] == 2, failure
    assert failure["message"] == "RuntimeError: rank 2 fails at step 5"
    assert failure["kind"] == "failed"
    assert remote[0].endswith(f"(node {failure['node']})"), (remote, failure)
