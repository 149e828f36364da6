"""torch's own TCPStore client in a process of its own, driven from a test's event loop.

Some of torch's Store bindings (the queue operations) hold the GIL while they block on the socket, so torch's
client cannot run in a thread of the process that serves the store: it runs in this script, one process per
peer, and the test talks to it over a pipe.

Protocol: one ``repr((op, args))`` per line in; one ``repr(("ok", result))`` or
``repr(("error", type_name, message))`` per line out. ``("connect", (host, port, timeout_s))`` opens a fresh
client (replacing the previous one); ``("wait", (keys, timeout_s))`` and ``("barrier", (key, n, timeout_s))`` take
their timeout in seconds; any other op is the ``TCPStore`` method of that name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from typing import Any

import anyio
import anyio.to_thread


class PeerError(Exception):
    """torch's client raised ``type_name``: ``message``."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


class TorchPeer:
    """A running ``torch_store_peer.py`` process; ``await peer.call(op, *args)`` runs one client call in it."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._read()  # ("ready", None): torch is imported

    def _read(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"torch peer exited with {self.process.wait()}")
        reply = ast.literal_eval(line)
        if reply[0] == "error":
            raise PeerError(reply[1], reply[2])
        return reply[1]

    def _call(self, op: str, args: tuple[Any, ...]) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(repr((op, args)) + "\n")
        self.process.stdin.flush()
        return self._read()

    async def call(self, op: str, *args: Any) -> Any:
        """Run ``store.<op>(*args)`` in the peer; a torch error is raised as :class:`PeerError`."""
        # The pipe read blocks; a thread keeps the event loop (and the server in it) running meanwhile.
        return await anyio.to_thread.run_sync(self._call, op, args, abandon_on_cancel=True)

    async def connect(self, host: str, port: int, client_timeout_s: float = 15.0) -> None:
        """A fresh ``TCPStore(host, port, is_master=False, timeout=client_timeout_s)`` in the peer."""
        await self.call("connect", host, port, client_timeout_s)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def main() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    store: Any = None
    print(repr(("ready", None)), flush=True)
    for line in sys.stdin:
        op, args = ast.literal_eval(line)
        try:
            if op == "connect":
                host, port, timeout = args
                store = None  # drop the previous connection first
                store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
                result: object = None
            elif store is None:
                raise RuntimeError("not connected")
            elif op == "wait":
                keys, timeout = args
                result = store.wait(keys, timedelta(seconds=timeout))
            elif op == "barrier" and len(args) == 3:
                key, world_size, timeout = args
                result = store.barrier(key, world_size, timedelta(seconds=timeout))
            else:
                result = getattr(store, op)(*args)
            reply: tuple[object, ...] = ("ok", result)
        except Exception as exc:  # every client error goes to the test, which asserts on it
            reply = ("error", type(exc).__name__, str(exc))
        print(repr(reply), flush=True)


if __name__ == "__main__":
    main()
