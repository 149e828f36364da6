"""``launch()`` (async) and ``run()`` (blocking, notebook-safe): the Python entry points of aelastic.

``await launch(config, entrypoint, *args)`` runs this node's agent inside the caller's event loop (asyncio or
trio) and returns the workers' return values by global rank, or raises :class:`ChildFailedError` whose message is
torch's failure report. Cancelling the awaiting task stops every worker (TERM, grace, KILL) before the
cancellation propagates; nothing is left running.

``run(config, entrypoint, *args)`` is the same call for synchronous code. Where an event loop already runs in
the calling thread (Jupyter, IPython), it runs the launch on a thread of its own with its own loop and blocks on
the result; a keyboard interrupt (the kernel's "interrupt") cancels the launch, which stops the workers.

An application that embeds a launch and steers it from outside (the command line is one) passes a
:class:`LaunchControl`: the signal a cancelled launch stops the workers with, an observer of this node's
rendezvous joins, and the signals it passes on to the running workers (a scheduler's notice: :meth:`LaunchControl.
forward` and, exactly once per worker, :meth:`LaunchControl.relay`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from . import events
from ._eventloop import run_options
from ._groups import single_error
from .agent.agent import ElasticAgent
from .agent.attempt import StopSignal
from .agent.errors import ChildFailedError, NoProgressError
from .agent.forward.parent import RunningWorkers, Witness, open_witness, sender_name
from .agent.logs import LogSpec
from .agent.options import AgentOptions, Features
from .agent.reaper.parent import Reaper, open_reaper
from .agent.workers import RunResult, WorkerSpec
from .config import LaunchConfig, new_run_id
from .config.environ import health_check_port, workers_identical
from .errors import RendezvousGracefulExitError
from .rendezvous.api import JoinObserver
from .rendezvous.registry import open_rendezvous

if TYPE_CHECKING:
    from .agent.checkpoint.parent import Keeper
    from .agent.nodecheck.parent import NodeCheck
    from .agent.prewarm.parent import Standbys

__all__ = ["LaunchControl", "launch", "run"]

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE = 10.0  # bound on closing the rendezvous when the agent is done


@dataclass(slots=True, eq=False)
class LaunchControl:
    """What an application holds to steer a launch from outside; mutable, read by the launch while it runs.

    Attributes:
        stop_signal: the signal a cancelled launch stops the workers with (SIGTERM unless set; the command line
            sets the signal it received, as torchrun forwards it).
        join_observer: called at each step of this node's rendezvous joins (the command line draws its live
            status line with it); ``None``: nobody observes.
        relayed: the signals the application will :meth:`relay` (the command line's ``--signals-to-forward``);
            for these the launch runs a witness process (:mod:`aelastic.agent.forward`). Read when the launch
            starts.
        running: the running workers' process groups, kept by the launch.
    """

    stop_signal: StopSignal = field(default_factory=StopSignal)
    join_observer: JoinObserver | None = None
    relayed: tuple[signal.Signals, ...] = ()
    running: RunningWorkers = field(default_factory=RunningWorkers, repr=False)
    witness: Witness | None = field(default=None, init=False, repr=False)
    checkpoints: Keeper | None = field(default=None, init=False, repr=False)

    def forward(self, signum: signal.Signals) -> int:
        """Send ``signum`` to the process group of every running worker of this node now; the workers and the
        agent run on. Returns how many groups were signalled (0 between attempts: nothing is queued). A
        scheduler's notice: the latest in-memory checkpoints are written to ``--checkpoint-dir`` too."""
        self._persist(signum)
        return len(self.running.signal(signum))

    def _persist(self, signum: signal.Signals) -> None:
        if self.checkpoints is not None:
            self.checkpoints.persist(f"{signal.Signals(signum).name} received")

    async def relay(self, signum: signal.Signals) -> bool:
        """Pass on ``signum``, which this process has just received, so that every worker sees it exactly once.

        If whoever sent it signalled the workers directly too (every process of a Slurm job step, say), nothing is
        forwarded; else it is, as :meth:`forward`. The witness of :mod:`aelastic.agent.forward` tells the two
        apart (``signum`` must be in :attr:`relayed`; else it is always forwarded); forwarding waits up to
        ``DIRECT_WINDOW`` (1 s) for its word. Logs one line either way. Returns whether it forwarded.
        Cancellation: nothing is forwarded.
        """
        signum = signal.Signals(signum)
        self._persist(signum)
        witness = self.witness
        if witness is not None and signum in witness.signums:
            receipt = await witness.wait_direct(signum)
            if receipt is not None:
                logger.warning(
                    "received %s from pid %d (%s), which signalled the workers directly too: not forwarded again",
                    signum.name, receipt.sender, sender_name(receipt.sender),
                )  # fmt: skip
                return False
        groups = self.running.signal(signum)
        if groups:
            logger.warning("received %s: forwarded to the workers' process groups %s", signum.name, groups)
        else:
            logger.warning("received %s while no worker runs (between attempts): not forwarded", signum.name)
        return bool(groups)


def endpoint_ports(config: LaunchConfig) -> list[int]:
    """The ports of the agent's endpoint: ``metrics_port`` and torch's ``TORCHELASTIC_HEALTH_CHECK_PORT`` (one
    listener each, both serving ``/health``)."""
    ports = [] if config.metrics_port is None else [config.metrics_port]
    port = health_check_port()
    if port is not None and port not in ports:
        ports.append(port)
    return ports


async def launch(
    config: LaunchConfig, entrypoint: str | Callable[..., Any], *args: Any, control: LaunchControl | None = None
) -> dict[int, Any]:
    """Run ``entrypoint`` on ``config.nproc_per_node`` workers of this node, elastically; see the module doc.

    ``entrypoint`` is an executable run with ``args`` (as torch's ``elastic_launch``:
    ``launch(cfg, sys.executable, "-u", "train.py")``) or a callable called with ``args`` in each worker (it may
    be defined in ``__main__`` or a notebook cell). ``control``: see :class:`LaunchControl` (default: a fresh one).

    Returns:
        The return values of this node's workers by global rank (``None`` for executables).

    Raises:
        ChildFailedError: a worker failed and no restart was left; the message is the failure report.
        RendezvousError: the rendezvous failed: ``RendezvousTimeoutError``, ``RendezvousClosedError``,
            ``RendezvousConnectionError``, ... (the subclass itself, never inside an ExceptionGroup).
        ConfigurationError: a bad ``--rdzv-conf`` value or endpoint.

    One error ending the launch is raised as itself; an ExceptionGroup comes out only when several independent
    errors happened together (e.g. the rendezvous store failed while stopping the workers failed too).
    """
    run_id = config.run_id or new_run_id()
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
        virtual_local_rank=config.virtual_local_rank,
    )
    logs, log_dir = _log_spec(config, run_id)
    run_dir = Path(tempfile.mkdtemp(prefix="aelastic_run_"))
    ports = endpoint_ports(config)
    if config.numa_options is not None:
        logger.warning("numa_options=%r: accepted for torch compatibility and ignored (aelastic binds nothing)",
                       config.numa_options)  # fmt: skip
    control = LaunchControl() if control is None else control
    try:
        with single_error(), events.open_event_log(config.event_log_handler, log_dir):
            result = await _run_agent(config, spec, logs, run_dir, run_id, ports, control)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if result is None:
        return {}
    if result.is_failed() and result.no_progress is not None:
        raise NoProgressError(spec.get_entrypoint_name(), result.failures, root_rank=result.first_failure_rank,
                              reason=result.no_progress)  # fmt: skip
    if result.is_failed():
        raise ChildFailedError(spec.get_entrypoint_name(), result.failures, root_rank=result.first_failure_rank)
    return dict(result.return_values)


def _log_spec(config: LaunchConfig, run_id: str) -> tuple[LogSpec, Path]:
    """Where the workers' output goes: ``<logs.dir>/<run id>_<random>/`` (``logs.dir``: a new temporary directory
    where the config names none), as torch's default layout."""
    log_root = Path(config.logs.dir) if config.logs.dir is not None else Path(tempfile.mkdtemp(prefix="torchelastic_"))
    log_root.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix=f"{run_id}_", dir=log_root))
    logs = LogSpec(
        role=config.role,
        log_dir=log_dir,
        redirects=config.logs.redirects,
        tee=config.logs.tee,
        local_ranks_filter=config.logs.local_ranks_filter,
        duplicate_stdout_filters=config.duplicate_filters[0],
        duplicate_stderr_filters=config.duplicate_filters[1],
        line_prefix_template=config.log_line_prefix_template,
    )
    return logs, log_dir


async def _run_agent(
    config: LaunchConfig,
    spec: WorkerSpec,
    logs: LogSpec,
    run_dir: Path,
    run_id: str,
    ports: list[int],
    control: LaunchControl,
) -> RunResult | None:
    """The agent's run and the rendezvous's closing; ``None`` if this node was in reserve when it closed."""
    async with (
        _open_node_check(config) as node_check,  # first: its check process imports torch while the rest starts
        _open_reaper(control.relayed) as reaper,
        _open_standbys(config, reaper) as standbys,
        _open_witness(control),
        _open_checkpoints(config, control) as checkpoints,
        open_rendezvous(config.rendezvous_parameters(run_id), observer=control.join_observer) as handler,
    ):
        options = AgentOptions(
            timeouts=config.timeouts,
            restarts=config.restarts,
            shutdown=config.shutdown_grace,
            identical_workers=workers_identical(),
            logs_specs=config.logs_specs,
        )
        features = Features(reaper, standbys, checkpoints, node_check, control.stop_signal, control.running)
        agent = ElasticAgent(spec, handler, logs, run_dir=run_dir, options=options, features=features)
        try:
            if ports:
                from .agent.control import run_with_endpoint  # h11 and the endpoint: only when asked for

                result = await run_with_endpoint(agent, ports, with_metrics=config.metrics_port is not None)
            else:
                result = await agent.run()
        except RendezvousGracefulExitError as exc:
            logger.info("rendezvous closed while this node was in reserve: %s", exc)
            return None
        # Done either way: close the rendezvous so nodes in reserve and late joiners exit (torch does the same;
        # a cancelled launch, e.g. on a signal, leaves it open for a rescheduled node).
        with anyio.move_on_after(_SHUTDOWN_GRACE, shield=True):
            await agent.shutdown()
    return result


@asynccontextmanager
async def _open_reaper(spared: tuple[signal.Signals, ...]) -> AsyncIterator[Reaper]:
    """The reaper sidecar, spawned with ``spared`` (the relayed signals) blocked: it inherits the mask through
    exec, so a notice sent to every process of the job step (Slurm's step signal) does not kill it."""
    async with AsyncExitStack() as stack:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, spared) if spared else None
        try:
            reaper = await stack.enter_async_context(open_reaper())  # spawned before its first checkpoint
        finally:
            if previous is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        yield reaper


@asynccontextmanager
async def _open_witness(control: LaunchControl) -> AsyncIterator[None]:
    """The witness of ``control.relayed`` (:mod:`aelastic.agent.forward`), for the launch's length; none if empty."""
    if not control.relayed:
        yield
        return
    async with open_witness(control.relayed) as witness:
        control.witness = witness
        try:
            yield
        finally:
            control.witness = None


@asynccontextmanager
async def _open_standbys(config: LaunchConfig, reaper: Reaper) -> AsyncIterator[Standbys | None]:
    """The standby interpreters when ``config.prewarm`` is on (after the reaper, so they die with it)."""
    if not config.prewarm.enabled:
        yield None
        return
    from .agent.prewarm.parent import open_standbys

    async with open_standbys(config.prewarm, reaper) as standbys:
        yield standbys


@asynccontextmanager
async def _open_checkpoints(config: LaunchConfig, control: LaunchControl) -> AsyncIterator[Keeper | None]:
    """The agent's in-memory checkpoints (:mod:`aelastic.agent.checkpoint`), unless ``checkpoint.memory`` is 0 (a
    scheduler's notice that ``control`` passes on persists them); its memory is released when the launch ends,
    however it ends."""
    if not config.checkpoint.limit(config.nproc_per_node):
        yield None
        return
    from .agent.checkpoint.parent import open_keeper

    async with open_keeper(
        config.checkpoint, nproc_per_node=config.nproc_per_node, multi_node=config.max_nodes > 1
    ) as keeper:
        control.checkpoints = keeper
        try:
            yield keeper
        finally:
            control.checkpoints = None


@asynccontextmanager
async def _open_node_check(config: LaunchConfig) -> AsyncIterator[NodeCheck | None]:
    """The node check (:mod:`aelastic.agent.nodecheck`) when ``config.node_check`` is on: its check process starts
    now, before the rendezvous, and ends with the launch."""
    if not config.node_check.enabled:
        yield None
        return
    from .agent.nodecheck.parent import open_node_check

    async with open_node_check(config.node_check, os.environ) as check:
        yield check


def _in_event_loop() -> bool:
    """Whether an asyncio or trio event loop runs in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return True
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def run(
    config: LaunchConfig,
    entrypoint: str | Callable[..., Any],
    *args: Any,
    backend: str = "asyncio",
    control: LaunchControl | None = None,
) -> dict[int, Any]:
    """Blocking :func:`launch`; works where an event loop already runs in this thread (Jupyter).

    Raises what :func:`launch` raises (``RendezvousTimeoutError`` itself, ``ChildFailedError``, ...).
    """
    call = partial(launch, config, entrypoint, *args, control=control)
    if not _in_event_loop():
        return anyio.run(call, backend=backend, backend_options=run_options(backend))
    from anyio.from_thread import start_blocking_portal  # only a caller inside a running loop (Jupyter) needs it

    with start_blocking_portal(backend) as portal:
        future = portal.start_task_soon(call)
        try:
            values: dict[int, Any] = future.result()
        except KeyboardInterrupt:
            future.cancel()  # the portal cancels the launch, which stops the workers before the portal closes
            raise
        return values
