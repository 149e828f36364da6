"""The ``aelastic`` command line: ``run`` (torchrun's flags), ``store``.

User errors print one line on stderr (``aelastic run: error: ...``) and exit with status 2; nothing is started,
and no traceback is shown. The library never installs log handlers: this module does, for the command line only.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

import anyio

from ._net import format_address
from .agent.errors import ChildFailedError
from .agent.logs import Std
from .config import DEFAULT_SIGNALS, LaunchConfig, parse_nnodes, parse_rdzv_conf, parse_signals
from .errors import AelasticError, ConfigurationError
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


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    nodes = parser.add_argument_group("Worker/node size")
    _add(nodes, "--nnodes", dest="nnodes", default="1:1", help="N or MIN:MAX nodes (default: %(default)s)")
    _add(nodes, "--nproc-per-node", dest="nproc_per_node", default="1",
         help="workers per node: an integer, cpu, gpu or auto (default: %(default)s)")  # fmt: skip

    rdzv = parser.add_argument_group("Rendezvous")
    _add(rdzv, "--rdzv-backend", dest="rdzv_backend", default="static",
         help="c10d, etcd, static, or a registered plugin (default: %(default)s)")  # fmt: skip
    _add(rdzv, "--rdzv-endpoint", dest="rdzv_endpoint", default="",
         help="HOST[:PORT] of the rendezvous store; [ADDR]:PORT for IPv6 (default: none)")  # fmt: skip
    _add(rdzv, "--rdzv-id", dest="rdzv_id", default="none", help="the job's run id (default: %(default)s)")
    _add(rdzv, "--rdzv-conf", dest="rdzv_conf", default="",
         help="KEY=VALUE,... e.g. join_timeout=600,last_call_timeout=30 (default: none)")  # fmt: skip
    _add_flag(rdzv, "--standalone", dest="standalone",
              help="single node: c10d on localhost with a free port and a random run id")  # fmt: skip
    _add(rdzv, "--local-addr", dest="local_addr", default=None,
         help="this node's address for rendezvous and the workers' store (default: the address used to reach "
         "the rendezvous store)")  # fmt: skip

    user = parser.add_argument_group("User-code launch")
    _add(user, "--max-restarts", dest="max_restarts", default=0, type=int,
         help="failure restarts before the job fails (default: %(default)s)")  # fmt: skip
    _add(user, "--monitor-interval", dest="monitor_interval", default=0.1, type=float,
         help="accepted for torchrun compatibility; aelastic awaits worker exits, it does not poll (default: "
         "%(default)s)")  # fmt: skip
    _add(user, "--start-method", dest="start_method", default="spawn", choices=["spawn", "fork", "forkserver"],
         help="accepted for compatibility; functions always run in a fresh interpreter (default: %(default)s)")
    _add(user, "--event-log-handler", dest="event_log_handler", default="null",
         help="accepted for compatibility (default: %(default)s)")  # fmt: skip
    _add(user, "--role", dest="role", default="default", help="worker role (default: %(default)s)")
    _add_flag(user, "-m", "--module", dest="module", help="run the script as a module (python -m)")
    _add_flag(user, "--no-python", dest="no_python", help="run the script as an executable, without python")
    _add_flag(user, "--run-path", dest="run_path", help="run the script with runpy.run_path in each worker")
    _add(user, "--signals-to-handle", dest="signals_to_handle", default=DEFAULT_SIGNALS,
         help="signals that stop the agent and its workers (default: %(default)s)")  # fmt: skip
    _add(user, "--shutdown-timeout", dest="shutdown_timeout", default=None, type=float,
         help="seconds between SIGTERM and SIGKILL when stopping workers (default: "
         "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30)")  # fmt: skip
    _add(user, "--numa-binding", dest="numa_binding", default=None,
         choices=["node", "socket", "exclusive", "core-complex"],
         help="accepted; aelastic does not bind workers to NUMA nodes (default: none)")  # fmt: skip
    _add_flag(user, "--virtual-local-rank", dest="virtual_local_rank",
              help="accepted for compatibility; LOCAL_RANK stays the real local rank")  # fmt: skip

    logs = parser.add_argument_group("Logging")
    _add(logs, "--log-dir", dest="log_dir", default=None,
         help="directory for attempt_<n>/<local_rank>/{stdout,stderr}.log and error.json (default: a temp dir)")
    _add(logs, "-r", "--redirects", dest="redirects", default="0",
         help="streams to files only: 0..3 or LOCAL_RANK:0..3,... (default: %(default)s)")  # fmt: skip
    _add(logs, "-t", "--tee", dest="tee", default="0",
         help="streams to files and the console: 0..3 or LOCAL_RANK:0..3,... (default: %(default)s)")
    _add(logs, "--local-ranks-filter", dest="local_ranks_filter", default="",
         help="comma list of local ranks whose output is shown (default: all)")  # fmt: skip
    _add(logs, "--log-line-prefix-template", dest="log_line_prefix_template", default=None,
         help="prefix with ${role_name} ${rank} ${local_rank} ${hostname} (default: [<role><local_rank>]:)")
    _add(logs, "--logs-specs", dest="logs_specs", default=None, help="accepted: only torch's default layout exists")
    _add(logs, "--duplicate-stdout-filters", dest="duplicate_stdout_filters", default="",
         help="accepted for compatibility (default: none)")  # fmt: skip
    _add(logs, "--duplicate-stderr-filters", dest="duplicate_stderr_filters", default="",
         help="accepted for compatibility (default: none)")  # fmt: skip

    static = parser.add_argument_group("Static rendezvous (--rdzv-backend static)")
    _add(static, "--node-rank", dest="node_rank", default=0, type=int, help="this node's rank (default: %(default)s)")
    _add(static, "--master-addr", dest="master_addr", default="127.0.0.1",
         help="address of the rank-0 node (default: %(default)s)")  # fmt: skip
    _add(static, "--master-port", dest="master_port", default=None, type=int,
         help="port of the rank-0 node's store (default: 29500)")  # fmt: skip

    parser.add_argument("training_script", help="the script (or module, or executable) every worker runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")


def _nproc(text: str) -> int:
    if text == "cpu" or text == "auto":
        return os.cpu_count() or 1
    if text == "gpu":
        count = len([d for d in os.listdir("/dev") if d[len("nvidia") :].isdigit() and d.startswith("nvidia")])
        if count == 0:
            raise ConfigurationError("--nproc-per-node 'gpu': no GPU on this machine (no /dev/nvidia<N>)")
        return count
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(
            f"--nproc-per-node {text!r}: must be a positive integer, cpu, gpu or auto"
        ) from None
    if value < 1:
        raise ConfigurationError(f"--nproc-per-node {text!r}: must be >= 1")
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


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, str | Callable[..., Any], list[str]]:
    """Map torchrun's arguments onto a LaunchConfig and a worker command, refusing bad input."""
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    nproc = _nproc(str(args.nproc_per_node))
    if args.max_restarts < 0:
        raise ConfigurationError(f"--max-restarts {args.max_restarts}: must be >= 0")
    if args.module and args.no_python:
        raise ConfigurationError("-m/--module and --no-python cannot be used together")
    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    rdzv_configs: dict[str, Any] = parse_rdzv_conf(args.rdzv_conf)
    auto_standalone = backend == "static" and not endpoint and args.master_port is None and max_nodes == 1
    if args.standalone or auto_standalone:
        if args.standalone and (endpoint or backend != "static"):
            logger.warning("--standalone: ignoring --rdzv-backend/--rdzv-endpoint; using c10d on localhost:0")
        backend, endpoint, run_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif backend == "static":
        rdzv_configs["rank"] = args.node_rank
        if not endpoint:
            endpoint = format_address(args.master_addr, args.master_port or 29500)
    elif args.node_rank != 0 or args.master_addr != "127.0.0.1":
        logger.warning("--node-rank/--master-addr only apply to --rdzv-backend static; ignored")
    if not endpoint and backend != "c10d":
        raise ConfigurationError(f"--rdzv-endpoint '': the {backend!r} backend needs HOST[:PORT]")
    parse_signals(args.signals_to_handle)
    shutdown = args.shutdown_timeout
    if shutdown is None:
        shutdown = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    if args.numa_binding:
        logger.warning("--numa-binding %s: aelastic does not bind workers to NUMA nodes; ignored", args.numa_binding)
    if args.virtual_local_rank:
        logger.warning("--virtual-local-rank: not supported; LOCAL_RANK stays the real local rank")
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        logger.warning(
            "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your "
            "system being overloaded, please further tune the variable for optimal performance in your "
            "application as needed."
        )
        os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = args.signals_to_handle
    template = args.log_line_prefix_template or os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
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
        log_line_prefix_template=template,
        shutdown_timeout=shutdown,
        signals_to_handle=args.signals_to_handle,
    )
    script, script_args = args.training_script, list(args.training_script_args)
    entrypoint: str | Callable[..., Any]
    if args.run_path:
        entrypoint, script_args = _run_script_path, [script, *script_args]
    elif args.no_python:
        entrypoint = script
    else:
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        entrypoint, script_args = python, ["-u", *(["-m"] if args.module else []), script, *script_args]
        if not args.module and not os.path.exists(script):
            raise ConfigurationError(f"training script {script!r}: no such file")
    return config, entrypoint, script_args


async def _run_job(config: LaunchConfig, entrypoint: str | Callable[..., Any], args: list[str]) -> int:
    from .launch import launch

    signals = parse_signals(config.signals_to_handle)
    received: list[int] = []
    async with anyio.create_task_group() as tg:

        async def on_signals() -> None:
            with anyio.open_signal_receiver(*signals) as receiver:
                async for signum in receiver:
                    if received:  # a second signal: no more grace
                        logger.warning("received %s again: killing workers now", signal.Signals(signum).name)
                        os._exit(128 + received[0])  # the reaper and the parent-death signal kill every worker
                    received.append(int(signum))
                    logger.warning("received %s: stopping workers", signal.Signals(signum).name)
                    job.cancel()

        tg.start_soon(on_signals)
        with anyio.CancelScope() as job:
            try:
                await launch(config, entrypoint, *args)
            except ChildFailedError as exc:
                print(exc.format_report(), file=sys.stderr, flush=True)
                tg.cancel_scope.cancel()
                return 1
        tg.cancel_scope.cancel()
    return 128 + received[0] if received else 0


# --- aelastic store -------------------------------------------------------------------------------------------


async def _run_store(host: str, port: int) -> int:
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_store, host, port)
        print(f"aelastic store listening on {format_address(host, server.port)}", flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                logger.info("stopping on %s", signal.Signals(signum).name)
                break
        tg.cancel_scope.cancel()
    return 0


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
        description="Launch this node's workers, rendezvous with the other nodes and supervise the workers: "
        "torchrun's flags, defaults and PET_<FLAG> variables.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    return parser


def _entry_run(args: argparse.Namespace) -> Callable[[], Any]:
    config, entrypoint, script_args = config_from_args(args)
    return partial(_run_job, config, entrypoint, script_args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
        entry = args.entry(args)
    except ConfigurationError as exc:
        prog = f"aelastic {args.command}" if "args" in locals() else "aelastic"
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return int(anyio.run(entry, backend=args.async_backend))
    except AelasticError as exc:
        print(f"aelastic {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
