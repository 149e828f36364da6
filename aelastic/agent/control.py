"""The agent's HTTP endpoint: ``/metrics`` (Prometheus text format) and ``/health``, served in the agent's loop.

Theory of operation
-------------------
:func:`serve_control` is a task in the launch's task group: it listens on a TCP port and runs one task per
connection, parsing HTTP/1.1 with h11 (keep-alive included, as Prometheus scrapes over one connection). Each request
is answered from :class:`~aelastic.agent.figures.AgentMetrics`, the state the agent updates as things happen, and from
the statistics of the store servers the agent's rendezvous handler runs (``handler.statistics().stores``): nothing
is computed between requests, and an answer at all proves the agent's event loop is responsive.

``/health`` (torch's ``TORCHELASTIC_HEALTH_CHECK_PORT``; torch's open-source server is a no-op) answers 200 while
the workers are running or starting, and 503 with a one-line JSON reason otherwise: workers stopped after a failure
or a membership change until they run again, the run over, or a worker marked unhealthy
(``AgentMetrics.unhealthy``, which a progress watchdog sets and clears). It answers 200 during a join, so it
says whether the agent is alive, not whether the node trains.

``/ready`` (a Kubernetes readiness probe's) says whether the node trains: 200 once this node's workers run after a
complete rendezvous round, 503 with the reason otherwise: before the first round completes, from the workers stopped
for a restart until they run again (the re-rendezvous included), while a worker is marked unhealthy, after the run.

``/metrics`` exists only when the endpoint was asked for with ``--metrics-port``; only then is
``prometheus-client`` imported.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.abc
import h11

from ..config.extras import METRICS_MISSING
from ..errors import AelasticError, ConfigurationError
from ..store import ServerStatistics
from .figures import RESTART_CAUSES, AgentMetrics
from .incidents.ledger import PHASES
from .workers import WorkerState

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import CollectorRegistry

    from .agent import ElasticAgent
    from .workers import RunResult

__all__ = ["health", "ready", "run_with_endpoint", "serve_control"]

logger = logging.getLogger(__name__)

StoreStatistics = Callable[[], Sequence[ServerStatistics]]
"""Where ``/metrics`` reads the statistics of the store servers to report, when scraped."""

# The gauge aelastic_worker_group_state has a series per state the agent can be in (UNKNOWN is torch's placeholder).
_STATES = tuple(s for s in WorkerState if s is not WorkerState.UNKNOWN)
_INCIDENT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)  # seconds


def health(metrics: AgentMetrics) -> tuple[int, dict[str, Any]]:
    """The ``/health`` answer for the agent's current state: ``(status, JSON body)``; see the module doc."""
    return _probe(metrics, ready=False)


def ready(metrics: AgentMetrics) -> tuple[int, dict[str, Any]]:
    """The ``/ready`` answer for the agent's current state: ``(status, JSON body)``; see the module doc."""
    return _probe(metrics, ready=True)


def _probe(metrics: AgentMetrics, *, ready: bool) -> tuple[int, dict[str, Any]]:
    """Both probes' answers: they agree but for the workers starting or exited (``/health``: the agent is alive;
    ``/ready``: the node trains, which needs a complete round and running workers)."""
    state = metrics.state
    body: dict[str, Any] = {"state": state.value, "workers_alive": metrics.workers_alive}
    if metrics.unhealthy:
        rank, why = min(metrics.unhealthy.items())
        return 503, {**body, "reason": f"local rank {rank} is unhealthy: {why}"}
    if metrics.stopped_reason is not None:
        again = "; re-rendezvous" if ready else ""
        return 503, {**body, "reason": f"workers stopped: {metrics.stopped_reason}{again}"}
    if WorkerState.is_running(state):
        if not ready:
            return 200, {**body, "reason": "workers running"}
        if metrics.workers_alive:
            return 200, {**body, "reason": "workers running after a complete rendezvous round"}
        return 503, {**body, "reason": "workers exited: the run ends or restarts"}
    if state is WorkerState.INIT:
        if not ready:
            return 200, {**body, "reason": "workers starting"}
        if metrics.rendezvous_count:
            return 503, {**body, "reason": "rendezvous round complete: workers starting"}
        return 503, {**body, "reason": "waiting for the first rendezvous round"}
    return 503, {**body, "reason": f"run over: workers {state.value.lower()}"}


def _no_stores() -> Sequence[ServerStatistics]:
    return ()


def _registry(metrics: AgentMetrics, stores: StoreStatistics = _no_stores) -> CollectorRegistry:
    try:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
        from prometheus_client.registry import Collector, CollectorRegistry
    except ImportError:
        raise ConfigurationError(METRICS_MISSING) from None

    role = [metrics.role]

    class AgentCollector(Collector):
        def collect(self) -> Iterator[Metric]:
            restarts = CounterMetricFamily(
                "aelastic_restarts", "worker-group restarts by cause", labels=["role", "cause"]
            )
            for cause in RESTART_CAUSES:
                restarts.add_metric([*role, cause], metrics.restarts[cause])
            yield restarts
            remaining = GaugeMetricFamily(
                "aelastic_remaining_restarts", "failure restarts left (torch's remaining_restarts)", labels=["role"]
            )
            remaining.add_metric(role, metrics.max_restarts - metrics.restarts["failure"])
            yield remaining
            alive = GaugeMetricFamily("aelastic_workers_alive", "this node's workers running", labels=["role"])
            alive.add_metric(role, metrics.workers_alive)
            yield alive
            state = GaugeMetricFamily(
                "aelastic_worker_group_state", "1 for the current state", labels=["role", "state"]
            )
            for each in _STATES:
                state.add_metric([*role, each.value], int(metrics.state is each))
            yield state
            for what, total, count, last, doc in (
                ("rendezvous", metrics.rendezvous_sum, metrics.rendezvous_count, metrics.rendezvous_last,
                 "rendezvous rounds joined (next_rendezvous)"),
                ("recovery", metrics.recovery_sum, metrics.recovery_count, metrics.recovery_last,
                 "restarts, from the workers stopped to the workers running again"),
            ):  # fmt: skip
                summary = SummaryMetricFamily(f"aelastic_{what}_duration_seconds", doc, labels=["role"])
                summary.add_metric(role, count_value=count, sum_value=total)
                yield summary
                if last is not None:
                    latest = GaugeMetricFamily(
                        f"aelastic_{what}_last_duration_seconds", f"latest: {doc}", labels=["role"]
                    )
                    latest.add_metric(role, last)
                    yield latest
            yield from _incident_metrics(metrics, CounterMetricFamily, GaugeMetricFamily)
            status, _ = health(metrics)
            healthy = GaugeMetricFamily("aelastic_healthy", "1 when /health answers 200", labels=["role"])
            healthy.add_metric(role, int(status == 200))
            yield healthy
            yield from _store_metrics(stores(), CounterMetricFamily, GaugeMetricFamily)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector())
    return registry


def _incident_metrics(
    metrics: AgentMetrics, counter: type[CounterMetricFamily], gauge: type[GaugeMetricFamily]
) -> Iterator[Metric]:
    """What the node's incidents cost (:mod:`aelastic.agent.incidents`): per phase, per cause, and the goodput."""
    from prometheus_client.core import HistogramMetricFamily

    role, incidents = [metrics.role], metrics.incidents.ended
    phases = HistogramMetricFamily(
        "aelastic_incident_phase_seconds", "each incident's time, by phase (detection to the work redone)",
        labels=["role", "phase"],
    )  # fmt: skip
    for phase in PHASES:
        values = [i.phases[phase] for i in incidents]
        buckets = [(str(b), sum(v <= b for v in values)) for b in _INCIDENT_BUCKETS] + [("+Inf", len(values))]
        phases.add_metric([*role, phase], buckets, sum(values))
    yield phases
    causes = counter("aelastic_incidents", "incidents by cause (failure, membership, hang)", labels=["role", "cause"])
    for cause in sorted({i.kind for i in incidents} | {"failure", "membership"}):
        causes.add_metric([*role, cause], sum(i.kind == cause for i in incidents))
    yield causes
    lost = counter("aelastic_incident_lost_seconds", "the time all incidents cost", labels=["role"])
    lost.add_metric(role, sum(i.lost for i in incidents))
    yield lost
    goodput = gauge("aelastic_goodput_ratio", "the share of the agent's time no incident lost", labels=["role"])
    goodput.add_metric(role, metrics.incidents.goodput(time.monotonic()))
    yield goodput


def _store_metrics(
    servers: Sequence[ServerStatistics], counter: type[CounterMetricFamily], gauge: type[GaugeMetricFamily]
) -> Iterator[Metric]:
    """The statistics of the store servers the agent's rendezvous handler runs (the rendezvous store on the c10d
    host, the workers' store of the round on group rank 0), labelled by what the store is for and its port. Each
    server counts as it serves (O(1) per request); this reads the counts. The workers' store is new every round,
    so its counters start again at 0 under a new port."""
    labels = ["store", "port"]
    requests = counter("aelastic_store_requests", "requests handled, by request kind", labels=[*labels, "command"])
    received = counter("aelastic_store_received_bytes", "bytes received from clients", labels=labels)
    sent = counter("aelastic_store_sent_bytes", "bytes of replies sent to clients", labels=labels)
    connections = gauge("aelastic_store_connections", "clients connected", labels=labels)
    keys = gauge("aelastic_store_keys", "keys in the store (queues not counted)", labels=labels)
    waiters = gauge("aelastic_store_waiters", "clients blocked in WAIT, BARRIER or a queue pop", labels=labels)
    for stats in sorted(servers, key=lambda server: server.port):
        store = [stats.name, str(stats.port)]
        for command, count in sorted(stats.ops_by_kind.items()):
            requests.add_metric([*store, command], count)
        received.add_metric(store, stats.bytes_received)
        sent.add_metric(store, stats.bytes_sent)
        connections.add_metric(store, stats.connections)
        keys.add_metric(store, stats.keys)
        waiters.add_metric(store, stats.waiters)
    yield from (requests, received, sent, connections, keys, waiters)


class _Routes:
    def __init__(self, metrics: AgentMetrics, with_metrics: bool, stores: StoreStatistics) -> None:
        self.metrics = metrics
        self.registry = _registry(metrics, stores) if with_metrics else None

    def answer(self, request: h11.Request) -> tuple[int, str, bytes]:
        path = request.target.split(b"?", 1)[0]
        if request.method not in (b"GET", b"HEAD"):
            return 405, "text/plain; charset=utf-8", b"only GET and HEAD\n"
        if path in (b"/health", b"/ready"):
            status, body = (health if path == b"/health" else ready)(self.metrics)
            return status, "application/json", json.dumps(body).encode() + b"\n"
        if path == b"/metrics" and self.registry is not None:
            from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        return (
            404,
            "text/plain; charset=utf-8",
            b"not found: /health, /ready" + (b", /metrics" if self.registry else b"") + b"\n",
        )


async def _serve_connection(stream: anyio.abc.ByteStream, *, routes: _Routes) -> None:
    try:
        async with stream:
            await _exchange(stream, h11.Connection(h11.SERVER), routes)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
        logger.debug("agent endpoint: a connection ended: %r", exc)  # the client's business, not the agent's


async def _exchange(stream: anyio.abc.ByteStream, conn: h11.Connection, routes: _Routes) -> None:
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return  # a malformed request: drop the connection, the agent goes on
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive()
            except anyio.EndOfStream:
                data = b""
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            status, content_type, body = routes.answer(event)
            headers = [("content-type", content_type), ("content-length", str(len(body)))]
            out = conn.send(h11.Response(status_code=status, headers=headers)) or b""
            if event.method != b"HEAD":
                out += conn.send(h11.Data(data=body)) or b""
            out += conn.send(h11.EndOfMessage()) or b""
            await stream.send(out)
        elif isinstance(event, h11.ConnectionClosed):
            return
        if conn.our_state is h11.MUST_CLOSE:
            return
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()


async def _listen(host: str, port: int) -> anyio.abc.Listener[anyio.abc.SocketStream]:
    try:
        return await anyio.create_tcp_listener(local_host=host, local_port=port)
    except OSError as exc:
        raise ConfigurationError(f"agent endpoint {host}:{port}: cannot listen: {exc}") from exc


async def _serve(listener: anyio.abc.Listener[anyio.abc.SocketStream], routes: _Routes) -> None:
    async with listener:
        await listener.serve(partial(_serve_connection, routes=routes))


async def serve_control(
    metrics: AgentMetrics,
    port: int,
    *,
    host: str = "0.0.0.0",
    with_metrics: bool,
    stores: StoreStatistics = _no_stores,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/health`` and ``/ready`` (and ``/metrics`` if ``with_metrics``) on ``host:port`` until cancelled;
    reports the bound port (``port`` 0 picks a free one) through ``task_status``. ``/metrics`` reports the store
    servers that ``stores()`` returns when scraped (none by default).

    Raises:
        ConfigurationError: ``with_metrics`` and prometheus-client is not installed, or the port cannot be bound.
    """
    routes = _Routes(metrics, with_metrics, stores)
    listener = await _listen(host, port)
    task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
    await _serve(listener, routes)


async def run_with_endpoint(agent: ElasticAgent, ports: Sequence[int], *, with_metrics: bool) -> RunResult:
    """``agent.run()`` with the endpoint served beside it on each of ``ports`` (one per distinct port asked for:
    ``--metrics-port`` and ``TORCHELASTIC_HEALTH_CHECK_PORT``) until the run ends. ``/metrics`` reports the store
    servers of the agent's rendezvous handler (``handler.statistics().stores``).

    Raises:
        ConfigurationError: as :func:`serve_control`, before the agent starts.
        AelasticError: what ``agent.run()`` raised, as itself (not in an exception group).
    """
    routes = _Routes(agent.metrics, with_metrics, lambda: agent.handler.statistics().stores)
    listeners: list[anyio.abc.Listener[anyio.abc.SocketStream]] = []
    try:
        for port in ports:
            listeners.append(await _listen("0.0.0.0", port))  # noqa: PERF401 (those bound so far are closed below)
    except ConfigurationError:
        for listener in listeners:
            await listener.aclose()
        raise
    logger.info("agent endpoint on port(s) %s: /health, /ready%s", list(ports), ", /metrics" if with_metrics else "")
    result: RunResult | None = None
    error: AelasticError | None = None
    async with anyio.create_task_group() as tg:
        for listener in listeners:
            tg.start_soon(_serve, listener, routes)

        async def run() -> None:
            nonlocal result, error
            try:
                result = await agent.run()
            except AelasticError as exc:  # raised as itself below, not in the task group's exception group
                error = exc
            finally:
                tg.cancel_scope.cancel()

        tg.start_soon(run)
    if error is not None:
        raise error
    return cast("RunResult", result)  # run() ended with a result or an error; a cancellation propagated above
