"""Events (torch's schema), the Prometheus ``/metrics`` endpoint and ``/health``: real agents, a real Prometheus."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
import test_agent_e2e
from test_agent_e2e import DEADLINE, Job, c10d, common, free_port, wait_participants

from aelastic.agent.control import health, serve_control
from aelastic.agent.figures import AgentMetrics
from aelastic.agent.workers import WorkerState
from aelastic.errors import ConfigurationError
from aelastic.events import Event, EventSource, check_event_handler, open_event_log, record, register_event_handler
from aelastic.store import wire
from aelastic.store.server import ServerSettings, StoreServer, open_store_server

pytestmark = pytest.mark.anyio

job = test_agent_e2e.job  # the end-to-end tests' fixtures: agents as processes, a rendezvous store no agent owns
rendezvous_store = test_agent_e2e.rendezvous_store

# torch 2.13's SimpleElasticAgent._construct_event, key for key and in order (reference §3.3).
TORCH_KEYS = [
    "run_id", "global_rank", "group_rank", "worker_id", "role", "hostname", "state", "total_run_time",
    "rdzv_backend", "raw_error", "metadata", "agent_restarts", "duration_ms",
]  # fmt: skip
TORCH_INNER = ["group_world_size", "entry_point"]
TORCH_WORKER_INNER = [*TORCH_INNER, "local_rank", "role_rank", "role_world_size", "exit_code", "worker_pid"]

# Worker: rank 0 fails on the first attempt, once rank 1 is armed (ignoring SIGTERM where IGNORE_TERM asks: the
# crash must not reach rank 1 before that, or its stop is quick and the window the health test watches is gone);
# on the next attempt every worker waits for <out>/go.
CRASH_ONCE = """
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
report("start", attempt=restart)
first = restart == "0" and os.environ["AELASTIC_MEMBERSHIP_RESTARTS"] == "0"
armed = os.path.join(OUT, "armed")
if first and os.environ["RANK"] == "0":
    while not os.path.exists(armed):
        time.sleep(0.05)
    sys.exit(3)
if first:
    if os.environ.get("IGNORE_TERM"):
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(armed, "w").close()
while not os.path.exists(os.path.join(OUT, "go")):
    time.sleep(0.05)
"""


def restarted(record: dict[str, Any]) -> bool:
    """A worker of the second attempt: a failure restart on the crashed node, a membership one on the other."""
    return "1" in (record["TORCHELASTIC_RESTART_COUNT"], record["AELASTIC_MEMBERSHIP_RESTARTS"])


# --- events --------------------------------------------------------------------------------------------------------


def event_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"name": ')]


@pytest.mark.torch
async def test_two_node_job_with_a_crash_prints_torch_events_and_rendezvous_events(
    job: Job, rendezvous_store: str
) -> None:
    from torch.distributed.elastic.events.api import Event as TorchEvent

    script = job.script("crash.py", CRASH_ONCE)
    began = time.time()
    flags = [*c10d(rendezvous_store, "2"), *common(1), "--max-restarts", "1", "--event-log-handler", "console"]
    agents = [await job.agent(*flags, script, job.out) for _ in range(2)]
    await job.wait_records("start", 2, restarted)
    (job.out / "go").touch()
    assert [await a.wait() for a in agents] == [0, 0], "\n".join(a.output for a in agents)
    ended = time.time()

    seen: list[dict[str, Any]] = []
    for agent in agents:
        lines = event_lines(agent.output)
        for line in lines:  # torch's own parser reads every line
            parsed = TorchEvent.deserialize(json.dumps(line))
            assert parsed.source.name in ("AGENT", "WORKER")
            assert began * 1000 <= line["timestamp"] <= ended * 1000, line  # a real timestamp, torch's is 0
        seen += lines
    names = {e["name"] for e in seen}
    assert {
        "torchelastic.worker.status.RENDEZVOUS",
        "torchelastic.worker.status.START",
        "torchelastic.worker.status.FAILED",
        "torchelastic.worker.status.SUCCEEDED",
        "aelastic.rendezvous.join",
        "aelastic.rendezvous.round_complete",
        "aelastic.rendezvous.closed",
    } <= names, names
    for event in seen:
        if event["name"].startswith("torchelastic.worker.status."):
            assert list(event["metadata"]) == TORCH_KEYS
            inner = json.loads(event["metadata"]["metadata"])
            assert list(inner) == (TORCH_WORKER_INNER if event["source"] == "WORKER" else TORCH_INNER)
    failed = [e for e in seen if e["name"] == "torchelastic.worker.status.FAILED" and e["source"] == "WORKER"]
    assert len(failed) == 1
    assert failed[0]["metadata"]["global_rank"] == 0
    assert json.loads(failed[0]["metadata"]["metadata"])["exit_code"] == [3]
    rounds = [e["metadata"] for e in seen if e["name"] == "aelastic.rendezvous.round_complete"]
    assert {r["world_size"] for r in rounds} == {2}
    assert len(rounds) == 4  # two nodes, two rounds
    assert all(r["duration_ms"] >= 0 for r in rounds)


# Report, then wait for <out>/go.
WAITS = """
report("start")
while not os.path.exists(os.path.join(OUT, "go")):
    time.sleep(0.05)
"""


async def test_a_sigkilled_peer_is_a_member_dead_event_and_start_events_carry_the_pids(
    job: Job, rendezvous_store: str
) -> None:
    script = job.script("waits.py", WAITS)
    conf = ("keep_alive_interval=0.5", "keep_alive_max_attempt=3")  # dead: no heartbeat for 1.5 s
    flags = [*common(1), "--max-restarts", "0", "--event-log-handler", "console", script, job.out]
    # The first round must have both nodes: the victim joins first and waits in a last call long enough for the
    # survivor to join. The survivor's 1 s last call then ends the round it is left alone in.
    victim = await job.agent(*c10d(rendezvous_store, "1:2", *conf, "last_call_timeout=60"), *flags)
    await wait_participants(rendezvous_store, 1)
    survivor = await job.agent(*c10d(rendezvous_store, "1:2", *conf), *flags)
    first = await job.wait_records("start", 2)
    victim.process.kill()
    again = await job.wait_records("start", 1, lambda r: r["WORLD_SIZE"] == "1")
    (job.out / "go").touch()
    assert await survivor.wait() == 0, survivor.output
    lines = event_lines(survivor.output)
    (dead,) = [e["metadata"] for e in lines if e["name"] == "aelastic.rendezvous.member_dead"]
    assert dead["run_id"] == "e2e"
    assert dead["round"] == 0  # the first round lost a member
    assert len(dead["dead"]) == 1
    assert dead["dead"][0].split("_")[-2] == str(victim.process.pid)  # addr_pid_localid of the killed agent
    assert dead["node"].split("_")[-2] == str(survivor.process.pid)  # reported by the node that removed it
    # START events: torch's worker_id is the worker's pid (inner worker_pid stays [null], as torch's START).
    starts = [e["metadata"] for e in lines if e["name"] == "torchelastic.worker.status.START"]
    survivor_pids = {r["pid"] for r in (*first, *again) if r["ppid"] == survivor.process.pid}
    assert {int(m["worker_id"]) for m in starts} == survivor_pids
    assert len(starts) == 2  # one worker, two attempts
    assert all(json.loads(m["metadata"])["worker_pid"] == [None] for m in starts)


async def test_file_and_registered_handlers_get_every_event(tmp_path: Path) -> None:
    with open_event_log("file", tmp_path):
        record("torchelastic.worker.status.START", EventSource.WORKER, {"role": "r"})
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [Event.deserialize(line).name for line in lines] == ["torchelastic.worker.status.START"]

    received: list[str] = []

    class Collect(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            received.append(rec.getMessage())

    register_event_handler("test-collect", lambda log_dir: Collect())
    with open_event_log("test-collect", tmp_path):
        record("aelastic.rendezvous.join", EventSource.AGENT, {"run_id": "x"})
    record("aelastic.rendezvous.join", EventSource.AGENT, {"run_id": "outside"})  # no log: dropped
    assert [Event.deserialize(m).metadata["run_id"] for m in received] == ["x"]


def test_unknown_event_handler_is_refused_with_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="--event-log-handler 'nosuch': no such handler"):
        check_event_handler("nosuch")
    done = subprocess.run(
        [sys.executable, "-m", "aelastic", "run", "--event-log-handler", "nosuch", "-m", "json.tool"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "no such handler" in done.stderr


# --- /health and /metrics in-process -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "stopped", "unhealthy", "status", "reason"),
    [
        ("INIT", None, {}, 200, "workers starting"),
        ("HEALTHY", None, {}, 200, "workers running"),
        ("INIT", "worker rank 0 failed", {}, 503, "workers stopped: worker rank 0 failed"),
        ("HEALTHY", None, {1: "no heartbeat for 30s"}, 503, "local rank 1 is unhealthy: no heartbeat for 30s"),
        ("SUCCEEDED", None, {}, 503, "run over: workers succeeded"),
        ("FAILED", None, {}, 503, "run over: workers failed"),
    ],
)
def test_health_rule(state: str, stopped: str | None, unhealthy: dict[int, str], status: int, reason: str) -> None:
    metrics = AgentMetrics("r", 1, state=WorkerState(state), stopped_reason=stopped, unhealthy=unhealthy)
    assert health(metrics) == (status, {"state": state, "workers_alive": 0, "reason": reason})


async def test_endpoint_serves_health_and_metrics_over_keep_alive_and_survives_garbage() -> None:
    metrics = AgentMetrics("trainer", 2)
    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: serve_control(metrics, 0, host="127.0.0.1", with_metrics=True,
                                                                 task_status=task_status))  # fmt: skip
        async with await anyio.connect_tcp("127.0.0.1", port) as garbage:
            await garbage.send(b"NOT HTTP AT ALL\r\n\r\n")
            with anyio.fail_after(10):
                assert b"".join([chunk async for chunk in garbage]) == b""  # dropped, not crashed
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            first = await client.get("/health")
            assert (first.status_code, first.json()["reason"]) == (200, "workers starting")
            metrics.restarted("failure", "worker rank 0 failed (exitcode 3)", 10.0)
            metrics.rendezvous_done(0.25)
            stopped = await client.get("/health")  # same connection (keep-alive)
            assert stopped.status_code == 503
            assert stopped.json()["reason"] == "workers stopped: worker rank 0 failed (exitcode 3); restart 1 (failure)"
            metrics.running(2, 12.5)
            page = (await client.get("/metrics")).text
            assert 'aelastic_restarts_total{cause="failure",role="trainer"} 1.0' in page
            assert 'aelastic_recovery_last_duration_seconds{role="trainer"} 2.5' in page
            assert 'aelastic_rendezvous_duration_seconds_sum{role="trainer"} 0.25' in page
            assert 'aelastic_workers_alive{role="trainer"} 2.0' in page
            assert (await client.head("/health")).status_code == 200
            assert (await client.post("/health")).status_code == 405
            assert (await client.get("/nope")).status_code == 404
        tg.cancel_scope.cancel()


def store_series(page: str, server: StoreServer) -> dict[str, float]:
    """``name{labels}`` → value for ``server``'s series on a /metrics page (labels other than store/port kept)."""
    own = f'port="{server.port}",store="{server.name}"'
    series = {}
    for line in page.splitlines():
        if line.startswith("aelastic_store_") and own in line:
            name, value = line.rsplit(" ", 1)
            series[name.replace(own, "").replace(",}", "}").replace("{}", "")] = float(value)
    return series


async def exchange(stream: anyio.abc.SocketStream, requests: list[wire.Request], reply_bytes: int) -> bytes:
    """Send ``requests`` as torch's client would and read ``reply_bytes`` of replies: once they are in, the server
    has handled every request (one connection is served in order)."""
    await stream.send(b"".join(wire.encode_request(r) for r in requests))
    data = b""
    with anyio.fail_after(DEADLINE):
        while len(data) < reply_bytes:
            data += await stream.receive()
    return data


async def test_metrics_expose_the_statistics_of_the_stores_the_handler_runs() -> None:
    metrics = AgentMetrics("trainer", 0)
    settings = ServerSettings(name="rendezvous")
    async with open_store_server("127.0.0.1", 0, settings) as server, anyio.create_task_group() as tg:
        # What an agent's endpoint reads from its rendezvous handler, statistics().stores, read when scraped.
        port = await tg.start(lambda task_status: serve_control(metrics, 0, host="127.0.0.1", with_metrics=True,
                                                                 stores=lambda: (server.statistics(),),
                                                                 task_status=task_status))  # fmt: skip
        async with (
            await anyio.connect_tcp("127.0.0.1", server.port) as first_client,
            await anyio.connect_tcp("127.0.0.1", server.port) as waiter,
            httpx.AsyncClient() as http,
        ):
            sets = [wire.Set(key, b"v") for key in (b"a", b"b", b"c")]
            requests = [wire.Validate(), *sets, wire.Get(b"a"), wire.Get(b"b"), wire.Add(b"n", 5)]
            await exchange(first_client, requests, 9 + 9 + 8)  # two values (length + byte), one int64
            # Nothing answers a WAIT for a missing key; the PING after it is answered once the WAIT was handled.
            waiting = [wire.Validate(), wire.Wait((b"late",)), wire.Ping(7)]
            assert await exchange(waiter, waiting, 4) == b"\x07\x00\x00\x00"
            first = store_series((await http.get(f"http://127.0.0.1:{port}/metrics")).text, server)
            assert {name: value for name, value in first.items() if "requests" in name} == {
                'aelastic_store_requests_total{command="Add"}': 1,
                'aelastic_store_requests_total{command="Get"}': 2,
                'aelastic_store_requests_total{command="Ping"}': 1,
                'aelastic_store_requests_total{command="Set"}': 3,
                'aelastic_store_requests_total{command="Validate"}': 2,
                'aelastic_store_requests_total{command="Wait"}': 1,
            }
            sent_in = sum(map(len, map(wire.encode_request, [*requests, *waiting])))
            assert first["aelastic_store_received_bytes_total"] == sent_in
            assert first["aelastic_store_sent_bytes_total"] == 26 + 4
            assert (first["aelastic_store_keys"], first["aelastic_store_waiters"]) == (4, 1)
            assert first["aelastic_store_connections"] == 2
            # SET: 1 + 8 + 4 + 8 + 0 bytes, no reply, and it wakes the waiter (STOP_WAITING, 1 byte out);
            # GETNUMKEYS: 1 byte in, an int64 out.
            await exchange(first_client, [wire.Set(b"late", b""), wire.GetNumKeys()], 8)
            assert await exchange(waiter, [], 1) == b"\x00"  # STOP_WAITING
            second = store_series((await http.get(f"http://127.0.0.1:{port}/metrics")).text, server)
            assert second["aelastic_store_received_bytes_total"] - sent_in == 21 + 1
            assert second["aelastic_store_sent_bytes_total"] - 30 == 1 + 8
            assert (second["aelastic_store_keys"], second["aelastic_store_waiters"]) == (5, 0)
        tg.cancel_scope.cancel()
    async with httpx.AsyncClient() as http, anyio.create_task_group() as tg:  # no store running: no store series
        port = await tg.start(lambda task_status: serve_control(metrics, 0, host="127.0.0.1", with_metrics=True,
                                                                 stores=tuple, task_status=task_status))  # fmt: skip
        assert "aelastic_store_keys{" not in (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        tg.cancel_scope.cancel()


# Two gloo workers meet on the workers' store, then wait for <out>/go.
GLOO_WAITS = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
report("ready")
while not os.path.exists(os.path.join(OUT, "go")):
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.torch
async def test_a_standalone_agent_exposes_its_rendezvous_store_and_the_workers_store(job: Job) -> None:
    script = job.script("gloo.py", GLOO_WAITS)
    port = free_port()
    agent = await job.agent("--standalone", *common(2), "--metrics-port", str(port), script, job.out)
    await job.wait_records("ready", 2)
    async with httpx.AsyncClient() as http:
        page = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    (job.out / "go").touch()
    assert await agent.wait() == 0, agent.output
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
              if line.startswith("aelastic_store_")}  # fmt: skip
    stores = {name.split('store="')[1].split('"')[0] for name in series}
    assert stores == {"rendezvous", "workers"}, page
    workers = {name: value for name, value in series.items() if 'store="workers"' in name}
    # torch's TCPStore client in each worker: one connection, one VALIDATE each, and every waiter answered.
    assert next(v for n, v in workers.items() if n.startswith("aelastic_store_connections")) == 2
    assert next(v for n, v in workers.items() if 'command="Validate"' in n) == 2
    assert next(v for n, v in workers.items() if n.startswith("aelastic_store_waiters")) == 0


def test_endpoint_off_imports_neither_prometheus_nor_the_endpoint() -> None:
    code = (
        "import sys, aelastic\n"
        "aelastic.run(aelastic.LaunchConfig(nproc_per_node=1), sys.executable, '-c', 'pass')\n"
        "print(sorted(m for m in ('prometheus_client', 'aelastic.agent.control', 'torch') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stderr


# --- real agents: /health through a restart, a real Prometheus scraping two agents -------------------------------


async def get_health(client: httpx.AsyncClient, port: int) -> tuple[int, dict[str, Any]]:
    try:
        answer = await client.get(f"http://127.0.0.1:{port}/health")
    except httpx.TransportError:
        return 0, {}  # the agent has not bound its endpoint yet
    return answer.status_code, answer.json()


async def wait_health(
    client: httpx.AsyncClient, ports: list[int], status: int, reason: str
) -> tuple[int, dict[str, Any]]:
    """The first of ``ports`` whose /health answers ``status`` with a reason starting with ``reason``."""
    with anyio.fail_after(DEADLINE):
        while True:
            for port in ports:
                code, body = await get_health(client, port)
                if code == status and body["reason"].startswith(reason):
                    return port, body
            await anyio.sleep(0.05)  # a probe is a poll by nature: what a kubelet does


@pytest.mark.torch
async def test_health_is_503_while_workers_are_stopped_for_a_restart_then_200(job: Job, rendezvous_store: str) -> None:
    """Node 0's worker fails; node 1's ignores SIGTERM, so node 1 takes --shutdown-timeout to stop it and node 0
    waits that long, workers stopped, in the next round: /health says 503 with the reason, then 200 again."""
    script = job.script("crash.py", CRASH_ONCE)
    ports = [free_port(), free_port()]
    flags = [*c10d(rendezvous_store, "2"), *common(1), "--max-restarts", "1", "--shutdown-timeout", "5"]
    agents = []
    for port in ports:
        os.environ["TORCHELASTIC_HEALTH_CHECK_PORT"] = str(port)
        os.environ["IGNORE_TERM"] = "1"
        try:
            agents.append(await job.agent(*flags, script, job.out))
        finally:
            del os.environ["TORCHELASTIC_HEALTH_CHECK_PORT"], os.environ["IGNORE_TERM"]
    async with httpx.AsyncClient() as client:
        crashed, stopped = await wait_health(client, ports, 503, "workers stopped: worker rank 0 failed (exitcode 3)")
        assert stopped["workers_alive"] == 0
        _, running = await wait_health(client, [crashed], 200, "workers running")
        assert running["state"] == "HEALTHY"
        await job.wait_records("start", 2, restarted)  # the group restarted on both nodes
        (job.out / "go").touch()
        assert [await a.wait() for a in agents] == [0, 0]


PROMETHEUS_CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: aelastic
    static_configs:
      - targets: [{targets}]
"""


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("Debian's prometheus package is not installed here (apt-get install prometheus; .ci/run does)")
    return found


@pytest.fixture
async def prometheus(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Path]]:
    """A real Prometheus on a free port; the test writes its targets into the returned config, then reloads."""
    binary = prometheus_binary()
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(PROMETHEUS_CONFIG.format(targets=""))
    log = (tmp_path / "prometheus.log").open("wb")
    process = await anyio.open_process(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}", "--web.enable-lifecycle",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            with anyio.fail_after(DEADLINE):
                while True:
                    try:
                        if (await client.get(f"{url}/-/ready")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await anyio.sleep(0.1)  # Prometheus announces readiness on this endpoint only
        yield url, config
    finally:
        with anyio.CancelScope(shield=True):
            process.terminate()
            await process.wait()
            log.close()


async def promql(client: httpx.AsyncClient, url: str, query: str) -> list[dict[str, Any]]:
    answer = (await client.get(f"{url}/api/v1/query", params={"query": query})).json()
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


@pytest.mark.torch
async def test_prometheus_scrapes_two_agents_through_a_failure_restart(
    job: Job, rendezvous_store: str, prometheus: tuple[str, Path]
) -> None:
    url, config = prometheus
    script = job.script("crash.py", CRASH_ONCE)
    ports = [free_port(), free_port()]
    flags = [*c10d(rendezvous_store, "2"), *common(1), "--max-restarts", "1"]
    agents = [await job.agent(*flags, "--metrics-port", str(port), script, job.out) for port in ports]
    config.write_text(PROMETHEUS_CONFIG.format(targets=", ".join(f"'127.0.0.1:{p}'" for p in ports)))
    async with httpx.AsyncClient() as client:
        assert (await client.post(f"{url}/-/reload")).status_code == 200
        await job.wait_records("start", 2, restarted)
        with anyio.fail_after(DEADLINE):
            while True:  # until a scrape after the restart has landed in Prometheus
                by_cause = await promql(client, url, "sum by (cause) (aelastic_restarts_total)")
                alive = await promql(client, url, "sum(aelastic_workers_alive)")
                restarts = sum(float(r["value"][1]) for r in by_cause)
                if alive and float(alive[0]["value"][1]) == 2 and restarts == 2:  # both nodes' restarts scraped
                    break
                await anyio.sleep(0.2)  # scrapes happen each second: poll the query API
        assert {r["metric"]["cause"]: float(r["value"][1]) for r in by_cause} == {"failure": 1.0, "membership": 1.0}
        failed = await promql(client, url, 'aelastic_restarts_total{cause="failure"} == 1')
        assert len(failed) == 1  # one node's worker failed; the other restarted on the membership change
        rendezvous = await promql(client, url, "aelastic_rendezvous_last_duration_seconds")
        assert len(rendezvous) == 2
        assert all(float(r["value"][1]) > 0 for r in rendezvous)
        counts = await promql(client, url, "aelastic_rendezvous_duration_seconds_count")
        assert sorted(float(r["value"][1]) for r in counts) == [2.0, 2.0]
    (job.out / "go").touch()
    assert [await a.wait() for a in agents] == [0, 0]


def test_ci_installs_prometheus() -> None:
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert "prometheus" in ci


# Under --watchdog-timeout, on the first attempt: node 1's worker ignores SIGTERM (so the new round waits
# --shutdown-timeout for it), then arms node 0's, which only then heartbeats and SIGSTOPs itself (hung, no more
# heartbeats). Nobody heartbeats before the arming: the watchdog's clock starts at a worker's first heartbeat.
STOPS_ITSELF = """
import signal
from aelastic import worker
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
first = restart == "0" and os.environ["AELASTIC_MEMBERSHIP_RESTARTS"] == "0"
report("start", attempt=restart)
armed = os.path.join(OUT, "armed")
if first and os.environ["GROUP_RANK"] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(armed, "w").close()
while first and not os.path.exists(armed):
    time.sleep(0.05)
worker.heartbeat()
if first and os.environ["GROUP_RANK"] == "0":
    os.kill(os.getpid(), signal.SIGSTOP)
while not os.path.exists(os.path.join(OUT, "go")):
    worker.heartbeat()
    time.sleep(0.05)
"""


@pytest.mark.torch
async def test_health_is_503_after_the_watchdog_kills_a_stopped_worker_then_200(
    job: Job, rendezvous_store: str
) -> None:
    script = job.script("stops_itself.py", STOPS_ITSELF)
    ports = [free_port(), free_port()]
    flags = [*c10d(rendezvous_store, "2"), *common(1), "--max-restarts", "1", "--shutdown-timeout", "5",
             "--watchdog-timeout", "2"]  # fmt: skip
    agents = []
    for port in ports:
        os.environ["TORCHELASTIC_HEALTH_CHECK_PORT"] = str(port)
        try:
            agents.append(await job.agent(*flags, script, job.out))
        finally:
            del os.environ["TORCHELASTIC_HEALTH_CHECK_PORT"]
    async with httpx.AsyncClient() as client:
        await job.wait_records("start", 2)
        hung, stopped = await wait_health(client, ports, 503, "workers stopped: worker rank 0 failed (exitcode -9)")
        assert stopped["workers_alive"] == 0, stopped  # the hung worker's node, whichever agent it is
        _, running = await wait_health(client, [hung], 200, "workers running")
        assert running["state"] == "HEALTHY"
        await job.wait_records("start", 2, restarted)
        (job.out / "go").touch()
        outputs = "\n".join(a.output for a in agents)
        assert [await a.wait() for a in agents] == [0, 0], outputs
    assert "expiration timer 'aelastic.heartbeat' expired: killed with SIGKILL" in outputs
