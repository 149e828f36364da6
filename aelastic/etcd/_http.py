"""HTTP/1.1 to etcd's JSON gateway: h11 over anyio's streams, with kept-alive connections per member.

The etcd client's calls are small POSTs, thousands at once when a large job meets (every node joins, beats and reads
in the same second): the cost per request is the client's CPU, and a general HTTP client spends several times what
h11 itself does (``benchmarks/rendezvous.py`` at 1,024 nodes). This module does only what the client needs: a POST
read whole, or a POST whose answer is read as a stream of lines (a watch); connections kept idle per member and
checked before reuse; and three kinds of failure, by what they say about the request:

* :class:`ConnectFailed` (and :class:`ConnectTimeout`): no connection, so the request was never sent;
* :class:`ReadTimeout`: sent, and no answer within the read timeout;
* :class:`ConnectionLost`: sent, and the connection broke before the whole answer came.

Each is a :class:`TransportError` whose cause is what the network raised (``_edge.describe`` reads it).
"""

from __future__ import annotations

import select
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

import anyio
import anyio.abc
import anyio.streams.tls
import h11

__all__ = [
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionLost",
    "HttpPool",
    "ReadTimeout",
    "Response",
    "StreamedResponse",
    "TransportError",
]

_CHUNK: Final = 65536
_IDLE_PER_MEMBER: Final = 16  # connections kept idle per member: each concurrent call holds one


class TransportError(Exception):
    """The network failed a request."""


class ConnectFailed(TransportError):
    """No connection to the member: the request was never sent."""


class ConnectTimeout(ConnectFailed):
    """No connection within the connect timeout."""


class ReadTimeout(TransportError):
    """The request was sent; no answer came within the read timeout."""


class ConnectionLost(TransportError):
    """The request was sent; the connection broke before the whole answer came."""


@dataclass(frozen=True, slots=True)
class Response:
    """An answer read whole."""

    status: int
    body: bytes
    local_address: str | None  # this host's address on the connection (what the member sees)


@dataclass(slots=True)
class _Connection:
    stream: anyio.abc.ByteStream
    fileno: int  # the socket's: read once (anyio's typed attributes cost more than a small call to look up)
    local_address: str | None  # this host's address on it
    http: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    idle_since: float = 0.0

    @classmethod
    def of(cls, stream: anyio.abc.ByteStream) -> _Connection:
        address = stream.extra(anyio.abc.SocketAttribute.local_address)
        local = str(address[0]).removeprefix("::ffff:") if isinstance(address, tuple) else None
        return cls(stream, stream.extra(anyio.abc.SocketAttribute.raw_socket).fileno(), local)

    def closed_by_peer(self) -> bool:
        """Whether the idle connection has something to read: the member closed it (or broke the protocol). poll(),
        not select(), which refuses descriptors past 1,023 (a process that simulates many nodes has more)."""
        poll = select.poll()
        poll.register(self.fileno, select.POLLIN)
        return bool(poll.poll(0))

    async def send(self, *events: h11.Event) -> None:
        """The events' bytes in one write (one system call for a whole small request)."""
        await self.stream.send(b"".join(self.http.send(event) or b"" for event in events))

    async def next_event(self, read_timeout: float | None) -> h11.Event:
        while True:
            event = self.http.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            with anyio.fail_after(read_timeout):
                try:
                    data = await self.stream.receive(_CHUNK)
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                    if isinstance(exc, anyio.EndOfStream):
                        data = b""
                    else:
                        raise ConnectionLost(str(exc) or type(exc).__name__) from exc
            self.http.receive_data(data)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(self.stream)


class StreamedResponse:
    """An answer read as it comes: its status, then its body line by line (:meth:`lines`)."""

    def __init__(self, connection: _Connection, status: int, read_timeout: float | None) -> None:
        self.status = status
        self.local_address = connection.local_address
        self._connection = connection
        self._read_timeout = read_timeout
        self._buffer = b""
        self._ended = False

    async def _data(self) -> bytes | None:
        """The next piece of the body, or None at its end."""
        try:
            event = await self._connection.next_event(self._read_timeout)
        except TimeoutError as exc:
            raise ReadTimeout(f"no data within {self._read_timeout}s") from exc
        except h11.RemoteProtocolError as exc:
            raise ConnectionLost(str(exc)) from exc
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return None
        raise ConnectionLost(f"unexpected {type(event).__name__} in an answer")

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = [self._buffer]
        self._buffer = b""
        while not self._ended and (data := await self._data()) is not None:
            parts.append(data)
        self._ended = True
        return b"".join(parts)

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines, without their ``\\n``; the last one even if it has none."""
        while True:
            line, sep, rest = self._buffer.partition(b"\n")
            if sep:
                self._buffer = rest
                yield line
                continue
            data = None if self._ended else await self._data()
            if data is None:
                self._ended = True
                if self._buffer:
                    yield self._buffer
                    self._buffer = b""
                return
            self._buffer += data


class HttpPool:
    """Connections to etcd's members (``http[s]://host:port``), kept alive between calls."""

    def __init__(self, ssl_context: ssl.SSLContext | None, *, connect_timeout: float, idle_kept: float) -> None:
        self._ssl_context = ssl_context
        self._connect_timeout = connect_timeout
        self._idle_kept = idle_kept
        self._idle: dict[str, list[_Connection]] = {}
        self.open = 0  # connections open now, idle or in use

    def __repr__(self) -> str:
        return f"<HttpPool open={self.open} idle={self.idle}>"

    @property
    def idle(self) -> int:
        """Connections kept open between calls."""
        return sum(map(len, self._idle.values()))

    async def _connect(self, endpoint: str) -> _Connection:
        parts = urlsplit(endpoint)
        host, tls = parts.hostname or "", parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        try:
            with anyio.fail_after(self._connect_timeout):
                stream: anyio.abc.ByteStream = await anyio.connect_tcp(host, port)
                if tls:
                    context = self._ssl_context or ssl.create_default_context()
                    try:
                        stream = await anyio.streams.tls.TLSStream.wrap(
                            stream, hostname=host, ssl_context=context, standard_compatible=False
                        )
                    except BaseException:
                        await anyio.aclose_forcefully(stream)
                        raise
            connection = _Connection.of(stream)
        except TimeoutError as exc:
            raise ConnectTimeout(f"no connection within {self._connect_timeout}s") from exc
        except (OSError, ssl.SSLError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        self.open += 1
        return connection

    async def _close(self, connection: _Connection) -> None:
        self.open -= 1
        await connection.aclose()

    async def _take(self, endpoint: str) -> _Connection:
        """An idle connection to ``endpoint`` that the member has not closed, else a new one."""
        idle = self._idle.get(endpoint, [])
        now = anyio.current_time()
        while idle:
            connection = idle.pop()
            if now - connection.idle_since < self._idle_kept and not connection.closed_by_peer():
                return connection
            await self._close(connection)
        return await self._connect(endpoint)

    def _keep(self, endpoint: str, connection: _Connection) -> bool:
        http = connection.http
        if http.our_state is not h11.DONE or http.their_state is not h11.DONE:
            return False
        idle = self._idle.setdefault(endpoint, [])
        if len(idle) >= _IDLE_PER_MEMBER:
            return False
        http.start_next_cycle()
        connection.idle_since = anyio.current_time()
        idle.append(connection)
        return True

    async def _request(
        self, connection: _Connection, endpoint: str, path: str, body: bytes, headers: dict[str, str],
        read_timeout: float | None,
    ) -> int:  # fmt: skip
        """Send a POST on ``connection`` and read its answer's status line and headers."""
        host = urlsplit(endpoint).netloc
        fields = [("Host", host), ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                  *headers.items()]  # fmt: skip
        try:
            await connection.send(h11.Request(method="POST", target=path, headers=fields), h11.Data(data=body),
                                  h11.EndOfMessage())  # fmt: skip
            while True:
                event = await connection.next_event(read_timeout)
                if isinstance(event, h11.Response):
                    return int(event.status_code)
                if not isinstance(event, h11.InformationalResponse):
                    raise ConnectionLost("the connection closed before an answer")
        except TimeoutError as exc:
            raise ReadTimeout(f"no answer within {read_timeout}s") from exc
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ConnectionLost(str(exc) or type(exc).__name__) from exc
        except h11.ProtocolError as exc:
            raise ConnectionLost(str(exc)) from exc

    async def post(
        self, endpoint: str, path: str, body: bytes, headers: dict[str, str], *, read_timeout: float | None
    ) -> Response:
        """POST ``body`` (JSON) to ``path`` on ``endpoint``; the answer read whole. (Not :meth:`stream` inside:
        the calls are many and small, and a context manager per call costs as much as the HTTP.)"""
        connection = await self._take(endpoint)
        kept = False
        try:
            status = await self._request(connection, endpoint, path, body, headers, read_timeout)
            response = StreamedResponse(connection, status, read_timeout)
            answer = Response(status, await response.read(), response.local_address)
            kept = self._keep(endpoint, connection)
            return answer
        finally:
            if not kept:
                await self._close(connection)

    @asynccontextmanager
    async def stream(
        self, endpoint: str, path: str, body: bytes, headers: dict[str, str], *, read_timeout: float | None
    ) -> AsyncIterator[StreamedResponse]:
        """POST ``body`` to ``path`` on ``endpoint``; the answer, its body read as it comes. The connection goes
        back to the pool if the body was read to its end, else it is closed (a call cancelled midway included).

        A stream (a watch) may hold its connection for the job's life, so it opens one of its own rather than take
        an idle one: those stay for the short calls, which would otherwise open a connection each when thousands
        of nodes start a round at once."""
        connection = await self._connect(endpoint)
        kept = False
        try:
            status = await self._request(connection, endpoint, path, body, headers, read_timeout)
            response = StreamedResponse(connection, status, read_timeout)
            yield response
            kept = response._ended and self._keep(endpoint, connection)
        finally:
            if not kept:
                await self._close(connection)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                await self._close(connection)
