"""The ``aelastic`` command line.

User errors print one line on stderr (``aelastic: error: ...``) and exit with status 2; nothing is started.
The library never installs log handlers: this module does, for the command line only.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from functools import partial

import anyio

from .store.server import serve_store

__all__ = ["main"]

_BACKENDS = ("asyncio", "trio")


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _wait_for_stop_signal() -> int:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            return int(signum)
    raise RuntimeError("signal receiver closed")  # pragma: no cover - the receiver never ends by itself


async def _run_store(host: str, port: int) -> int:
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_store, host, port)
        print(f"aelastic store listening on {format_address(host, server.port)}", flush=True)
        signum = await _wait_for_stop_signal()
        logging.getLogger("aelastic").info("stopping on %s", signal.Signals(signum).name)
        tg.cancel_scope.cancel()
    return 0


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (an integer 0..65535)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (an integer 0..65535)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aelastic", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--async-backend",
        choices=_BACKENDS,
        default=os.environ.get("AELASTIC_ASYNC_BACKEND", "asyncio"),
        help="event loop to run on (default: %(default)s; env AELASTIC_ASYNC_BACKEND)",
    )
    parser.add_argument("--log-level", default=os.environ.get("LOGLEVEL", "WARNING"), help="default: %(default)s")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return anyio.run(args.entry(args), backend=args.async_backend)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
