"""Checkpoints between agents: the replica each agent keeps of the next node's ranks, and fetches of a rank's
checkpoint by the node that restores it (agent to agent, TCP).

Protocol: a connection carries one request. A request is a *frame* (a 4-byte big-endian length, then that many
bytes of UTF-8 JSON), followed for a push by the checkpoint's bytes (:mod:`aelastic.worker._checkpoint.layout`); the
answer is a frame, followed for a fetch by the checkpoint's bytes::

    {"op": "push", "secret": S, "rank": r, "step": s, "size": n} + n bytes   ->  {} | {"error": "..."}
    {"op": "fetch", "secret": S, "rank": r, "step": s}                       ->  {"size": n} + n bytes | {"error": ...}
    {"op": "metadata", "secret": S, "rank": r, "step": s}                    ->  {"size": m} + header + m bytes | ...

A ``metadata`` request asks for a checkpoint's header and metadata only (a DCP load reads the metadata of saved ranks
whose data it may never read): the fetching agent keeps them at their places in a memory file whose data area is a
hole, which the worker maps and reads as a whole checkpoint's.

Every request carries the job's secret, which group rank 0 hands every node in the rank exchange (through the round
store, which ``--rdzv-conf auth_token`` protects); a connection that presents another is closed. The server listens
on the node's own address only. Bytes go from a memory file to the socket with ``sendfile`` and from the socket into
the receiving memory file (mapped in the agent) with ``recv_into``: nothing is copied through Python objects. The
sockets are the agent's own, non-blocking, awaited with ``anyio.wait_readable``/``wait_writable``: the same code on
asyncio and trio. Every transfer has a deadline that grows with its size (:func:`deadline`), so a peer that stalls
holds no slot for long.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import mmap
import os
import socket
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, Final, Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from ..._net import format_address, parse_endpoint
from ...worker._checkpoint.layout import HEADER_SIZE, Header, LayoutError
from .slots import Read, Slot

__all__ = ["ReplicaError", "ReplicaHolder", "deadline", "fetch", "fetch_metadata", "open_listener", "push", "serve"]

logger = logging.getLogger(__name__)

_MAX_FRAME: Final = 1 << 16
_CHUNK: Final = 16 << 20  # between two chunks a transfer lets the event loop run (heartbeats, other transfers)


class ReplicaError(Exception):
    """A transfer failed: the peer refused it, broke the protocol, went away or stalled; the message says which."""


class ReplicaHolder(Protocol):
    """What the server needs of the agent's checkpoints (:class:`~.parent.Keeper`)."""

    @property
    def secret(self) -> str | None: ...

    async def slot_to_receive(self, rank: int, size: int) -> Slot:
        """A slot of ``rank``'s replicas, at least ``size`` bytes, to receive a checkpoint into."""
        ...

    def received(self, slot: Slot, header: Header, sender: str) -> None:
        """``slot`` now holds the complete checkpoint ``header`` describes, pushed from ``sender``."""
        ...

    def slot_to_send(self, rank: int, step: int) -> Slot | None:
        """The complete slot of ``rank``'s ``step`` held here (own or replica), if any."""
        ...


def deadline(size: int) -> float:
    """Seconds a transfer of ``size`` bytes may take: 30 s, and 10 s more per 100 MiB (a 80 Mbit/s floor)."""
    return 30.0 + 10.0 * size / (100 << 20)


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = 0
        with suppress(BlockingIOError):
            sent = sock.send(view)
        if sent:
            view = view[sent:]
        else:
            await anyio.wait_writable(sock)


async def _send_file(sock: socket.socket, fd: int, size: int, read: Read) -> None:
    offset = 0
    while offset < size:
        if read.stop.is_set():
            raise ReplicaError("stopped: the slot is wanted for a newer checkpoint")
        sent = -1
        with suppress(BlockingIOError):
            sent = os.sendfile(sock.fileno(), fd, offset, min(size - offset, _CHUNK))
        if sent == 0:
            raise ReplicaError(f"the memory file ended at {offset} of {size} bytes")
        if sent > 0:
            offset += sent
            await anyio.lowlevel.checkpoint()
        else:
            await anyio.wait_writable(sock)


async def _receive_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view``. It keeps no slice of it past a call (nor in a traceback's frames): a mapping under it can be
    closed once the caller releases it, whatever ended the receive."""
    done = since = 0
    while done < len(view):
        count = -1
        with suppress(BlockingIOError):
            count = sock.recv_into(view[done:], min(len(view) - done, _CHUNK))
        if count == 0:
            raise ReplicaError("the peer closed the connection")
        if count > 0:
            done, since = done + count, since + count
            if since >= _CHUNK:
                since = 0
                await anyio.lowlevel.checkpoint()
        else:
            await anyio.wait_readable(sock)


async def _send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    await _send_all(sock, len(data).to_bytes(4, "big") + data)


async def _receive_frame(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(4)
    await _receive_into(sock, memoryview(head))
    size = int.from_bytes(head, "big")
    if size > _MAX_FRAME:
        raise ReplicaError(f"a frame of {size} bytes: not this protocol")
    body = bytearray(size)
    await _receive_into(sock, memoryview(body))
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise ReplicaError(f"a frame that is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ReplicaError("a frame that is not a JSON object")
    return message


async def _receive_checkpoint(sock: socket.socket, slot: Slot, size: int) -> Header:
    """``size`` bytes into ``slot``'s memory file, then its header, checked."""
    with mmap.mmap(slot.fd, slot.capacity) as mapped, memoryview(mapped) as whole, whole[:size] as view:
        await _receive_into(sock, view)
    try:
        header = slot.read_header()
    except LayoutError as exc:
        raise ReplicaError(f"received {size} bytes that are not a complete checkpoint: {exc}") from None
    if header.total != size:
        raise ReplicaError(f"received {size} bytes of a checkpoint of {header.total}")
    return header


async def _connect(endpoint: str) -> socket.socket:
    host, port = parse_endpoint(endpoint, None, what="replica endpoint")
    failure: OSError | None = None
    for family, kind, proto, _, address in await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            code = sock.connect_ex(address)
            if code == errno.EINPROGRESS:
                await anyio.wait_writable(sock)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, os.strerror(code))
        except OSError as exc:
            sock.close()
            failure = exc
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise ReplicaError(f"cannot connect to {endpoint}: {failure or 'no address'}")


async def push(endpoint: str, secret: str, slot: Slot, header: Header, read: Read) -> None:
    """Send ``slot`` (the checkpoint ``header`` describes) to the agent at ``endpoint`` as its replica.

    Raises:
        ReplicaError: refused, stopped (``read``), the connection failed, or the deadline passed.
    """
    try:
        with anyio.fail_after(deadline(header.total)):
            sock = await _connect(endpoint)
            with sock:
                request = {"op": "push", "secret": secret, "rank": header.rank, "step": header.step,
                           "size": header.total}  # fmt: skip
                await _send_frame(sock, request)
                await _send_file(sock, slot.fd, header.total, read)
                reply = await _receive_frame(sock)
    except OSError as exc:
        raise ReplicaError(f"pushing to {endpoint}: {exc}") from exc
    except TimeoutError:
        raise ReplicaError(
            f"pushing {header.total} bytes to {endpoint} took over {deadline(header.total):g} s"
        ) from None
    if "error" in reply:
        raise ReplicaError(f"{endpoint} refused the replica: {reply['error']}")


async def fetch_metadata(endpoint: str, secret: str, rank: int, step: int) -> tuple[int, Header]:
    """Rank ``rank``'s checkpoint of ``step`` from the agent at ``endpoint`` without its data: a memory file of the
    checkpoint's size holding its header and metadata (the data area a hole, which takes no memory), and the header.
    The caller closes the file.

    Raises:
        ReplicaError: the peer does not hold it, the connection failed, or the deadline passed.
    """
    try:
        sock = await _connect(endpoint)
        with sock, anyio.fail_after(deadline(0)):
            await _send_frame(sock, {"op": "metadata", "secret": secret, "rank": rank, "step": step})
            reply = await _receive_frame(sock)
            if "error" in reply:
                raise ReplicaError(f"{endpoint}: {reply['error']}")
            head = bytearray(HEADER_SIZE)
            await _receive_into(sock, memoryview(head))
            header = Header.decode(bytes(head))
            if (header.rank, header.step, header.meta_size) != (rank, step, int(reply["size"])):
                raise ReplicaError(f"{endpoint} sent rank {header.rank}'s metadata of step {header.step}, not rank "
                                   f"{rank}'s of step {step}")  # fmt: skip
            meta = bytearray(header.meta_size)
            await _receive_into(sock, memoryview(meta))
    except OSError as exc:
        raise ReplicaError(f"fetching rank {rank}'s metadata of step {step} from {endpoint}: {exc}") from exc
    except TimeoutError:
        raise ReplicaError(f"fetching rank {rank}'s metadata of step {step} from {endpoint}: no complete answer in "
                           "time") from None  # fmt: skip
    except LayoutError as exc:
        raise ReplicaError(f"{endpoint} sent a header that is not a checkpoint's: {exc}") from None
    fd = os.memfd_create(f"aelastic-metadata-{rank}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, header.total)
        os.pwrite(fd, head, 0)
        os.pwrite(fd, meta, header.meta_offset)
    except BaseException:
        os.close(fd)
        raise
    return fd, header


async def fetch(
    endpoint: str, secret: str, rank: int, step: int, slot_for: Callable[[int], Awaitable[Slot]]
) -> tuple[Slot, Header]:
    """Rank ``rank``'s checkpoint of ``step`` from the agent at ``endpoint``, received into ``slot_for(size)``.

    Raises:
        ReplicaError: the peer does not hold it, the connection failed, or the deadline passed.
    """
    try:
        sock = await _connect(endpoint)
        with sock:
            with anyio.fail_after(deadline(0)):
                await _send_frame(sock, {"op": "fetch", "secret": secret, "rank": rank, "step": step})
                reply = await _receive_frame(sock)
            if "error" in reply:
                raise ReplicaError(f"{endpoint}: {reply['error']}")
            size = int(reply["size"])
            slot = await slot_for(size)
            with anyio.fail_after(deadline(size)):
                header = await _receive_checkpoint(sock, slot, size)
    except OSError as exc:
        raise ReplicaError(f"fetching rank {rank}'s step {step} from {endpoint}: {exc}") from exc
    except TimeoutError:
        raise ReplicaError(f"fetching rank {rank}'s step {step} from {endpoint}: no complete answer in time") from None
    if (header.rank, header.step) != (rank, step):
        raise ReplicaError(f"{endpoint} sent rank {header.rank}'s step {header.step}, not rank {rank}'s step {step}")
    return slot, header


def open_listener(host: str) -> tuple[socket.socket, str]:
    """A listening socket on ``host`` (a port from the kernel), and its endpoint."""
    listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=128)  # fmt: skip
    listener.setblocking(False)
    return listener, format_address(host, listener.getsockname()[1])


async def serve(listener: socket.socket, holder: ReplicaHolder) -> None:
    """Answer pushes and fetches on ``listener`` until cancelled (it closes the listener then)."""
    with listener:
        async with anyio.create_task_group() as tg:
            while True:
                await anyio.wait_readable(listener)
                try:
                    conn, address = listener.accept()
                except (BlockingIOError, ConnectionAbortedError):
                    continue
                conn.setblocking(False)
                tg.start_soon(_answer, conn, format_address(*address[:2]), holder)


async def _answer(conn: socket.socket, peer: str, holder: ReplicaHolder) -> None:
    with conn:
        try:
            with anyio.fail_after(deadline(0)):
                request = await _receive_frame(conn)
            secret = holder.secret
            if secret is None or not hmac.compare_digest(str(request.get("secret", "")), secret):
                logger.warning("checkpoint replicas: %s presented no valid secret: connection closed", peer)
                return
            if request.get("op") == "push":
                await _take_push(conn, peer, holder, request)
            elif request.get("op") in ("fetch", "metadata"):
                held = _held(holder, request)
                if isinstance(held, str):
                    await _send_frame(conn, {"error": held})
                elif request["op"] == "fetch":
                    await _give_fetch(conn, *held)
                else:
                    await _give_metadata(conn, *held)
        except (OSError, ReplicaError, ValueError, KeyError, TypeError) as exc:
            logger.warning("checkpoint replicas: a request from %s failed: %s", peer, exc)
        except TimeoutError:
            logger.warning("checkpoint replicas: a request from %s took too long: connection closed", peer)


async def _take_push(conn: socket.socket, peer: str, holder: ReplicaHolder, request: dict[str, Any]) -> None:
    rank, step, size = int(request["rank"]), int(request["step"]), int(request["size"])
    slot = await holder.slot_to_receive(rank, size)
    with anyio.fail_after(deadline(size)):
        header = await _receive_checkpoint(conn, slot, size)
        if (header.rank, header.step) != (rank, step):
            raise ReplicaError(f"a push of rank {rank}'s step {step} holds rank {header.rank}'s step {header.step}")
        holder.received(slot, header, peer.rpartition(":")[0])  # the pushing node's host: its port is ephemeral
        await _send_frame(conn, {})


def _held(holder: ReplicaHolder, request: dict[str, Any]) -> tuple[Slot, Header] | str:
    """The slot of the checkpoint ``request`` asks for, and its header; or why there is none."""
    rank, step = int(request["rank"]), int(request["step"])
    slot = holder.slot_to_send(rank, step)
    if slot is None or slot.header is None:
        return f"this agent holds no checkpoint of rank {rank}'s step {step}"
    return slot, slot.header


async def _give_metadata(conn: socket.socket, slot: Slot, header: Header) -> None:
    with slot.reading():  # read at once, while no writer may take the slot
        head, meta = os.pread(slot.fd, HEADER_SIZE, 0), os.pread(slot.fd, header.meta_size, header.meta_offset)
    with anyio.fail_after(deadline(len(meta))):
        await _send_frame(conn, {"size": len(meta)})
        await _send_all(conn, head + meta)


async def _give_fetch(conn: socket.socket, slot: Slot, header: Header) -> None:
    with slot.reading() as read, anyio.fail_after(deadline(header.total)):
        await _send_frame(conn, {"size": header.total})
        await _send_file(conn, slot.fd, header.total, read)
