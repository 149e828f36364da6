"""The agent's end of each worker's link (see :mod:`aelastic.agent.link`; the protocol is in
:mod:`aelastic.worker._link`).

:class:`WorkerLink` makes the socket pair before the worker starts; the worker inherits its end (``pass_fds``, or
``SCM_RIGHTS`` to a standby) and finds it through :data:`~aelastic.worker._link.LINK_ENV`. :meth:`WorkerLink.serve`
answers the worker's requests in the agent's event loop for as long as the worker holds its end: an ``exit`` report is
the link's own (it sets :attr:`WorkerLink.exit_code`); every other operation is ``<service>.<name>`` and goes to the
:class:`LinkService` registered under that service's name. A service refuses a request by raising
:class:`LinkRefusal`, whose message the worker receives as the reason.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import Any, Protocol

import anyio

from ...worker._link import LINK_ENV, MAX_FDS, MAX_MESSAGE
from ..spawn.parent import FdVar, WorkerProcess

__all__ = ["LinkRefusal", "LinkService", "WorkerLink"]

logger = logging.getLogger(__name__)


class LinkRefusal(Exception):
    """Raised by a service to refuse a request; the message (one line) is what the worker is told."""


class LinkService(Protocol):
    """A feature that answers workers' requests over their links."""

    async def handle(
        self, worker: WorkerProcess, op: str, message: Mapping[str, Any]
    ) -> tuple[dict[str, Any], Sequence[int]]:
        """Answer ``op`` (the part after the service's name) from ``worker``. Returns the reply and the fds to pass
        (the caller closes none of them)."""
        ...


class WorkerLink:
    """The agent's end of one worker's link."""

    def __init__(self) -> None:
        agent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # neither inheritable
        agent_end.setblocking(False)
        self._socket = agent_end
        self._worker_fd = worker_end.detach()
        self.exit_code: int | None = None  # the status the worker reported before its teardown
        self.exited = anyio.Event()

    def __repr__(self) -> str:
        return f"<WorkerLink exit_code={self.exit_code} worker_fd={self._worker_fd}>"

    def fd_var(self) -> FdVar:
        """The worker's end, and the variable that names it (with the agent's pid: see
        :func:`aelastic.worker._link.agent_link`)."""
        return FdVar(LINK_ENV, f"{{}}:{os.getpid()}", (self._worker_fd,))

    def handed_over(self) -> None:
        """The worker holds its end now: drop the agent's copy, so that the link ends with the worker."""
        if self._worker_fd >= 0:
            fd, self._worker_fd = self._worker_fd, -1
            os.close(fd)

    async def serve(self, identity: Callable[[], WorkerProcess], services: Mapping[str, LinkService]) -> None:
        """Answer the worker's requests until it closes its end (it exited) or this is cancelled; ``identity()`` says
        who the worker is at each request (a survivor of an in-process restart changes ranks)."""
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._socket, MAX_MESSAGE, MAX_FDS)
            except BlockingIOError:
                await anyio.wait_readable(self._socket)
                continue
            except OSError as exc:  # ECONNRESET: the worker died
                logger.debug("link of rank %d: %s", identity().global_rank, exc)
                return
            for fd in fds:  # no request passes the agent any
                os.close(fd)
            if not data:
                return
            try:
                message = json.loads(data)
                op, ident = str(message["op"]), message.get("id")
            except (ValueError, KeyError, TypeError, AttributeError):
                await self._send(json.dumps({"error": "not a request of the link's protocol"}).encode(), ())
                continue
            reply, passed = await self._answer(identity(), services, op, message)
            await self._send(json.dumps({**reply, "id": ident}).encode(), passed)

    async def _answer(
        self,
        worker: WorkerProcess,
        services: Mapping[str, LinkService],
        op: str,
        message: Mapping[str, Any],
    ) -> tuple[dict[str, Any], Sequence[int]]:
        if op == "exit":
            code = int(message.get("code", 1))
            if self.exit_code is None and code:  # only failures are reported (a success ends by the kernel's word)
                self.exit_code = code
                self.exited.set()
            return {}, ()
        service_name, _, name = op.partition(".")
        service = services.get(service_name)
        if service is None:
            return {"error": f"this agent offers no {service_name!r} service"}, ()
        try:
            return await service.handle(worker, name, message)
        except LinkRefusal as exc:
            return {"error": str(exc)}, ()

    async def _send(self, data: bytes, fds: Sequence[int]) -> None:
        try:
            while True:
                with suppress(BlockingIOError):
                    socket.send_fds(self._socket, [data], list(fds))
                    return
                await anyio.wait_writable(self._socket)
        except OSError as exc:  # the worker is gone: nobody to answer
            logger.debug("link: reply not sent: %s", exc)

    def close(self) -> None:
        self.handed_over()
        with suppress(OSError):
            self._socket.close()
