"""Where the client meets the network: a transport failure or an HTTP answer turned into one short reason or the
error a caller meets (:class:`EndpointFailed`: try the next member), and one streaming call's lines
(:class:`Stream`)."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, suppress
from typing import Any, Final

import anyio

from ..errors import EtcdConnectionError, EtcdRequestError
from ._http import ConnectFailed, ConnectTimeout, ReadTimeout, TransportError
from .config import EtcdConfig

__all__ = ["UNAVAILABLE", "EndpointFailed", "Stream", "all_failed", "close_stack", "describe", "http_error", "was_sent"]


UNAVAILABLE: Final = 14  # "no leader", "leader changed": another member may answer


def chain(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes and contexts, and the members of exception groups among them (trio's connect)."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop(0)
        if current in seen:
            continue
        seen.append(current)
        todo.extend(getattr(current, "exceptions", ()))
        cause = current.__cause__ or current.__context__
        if cause is not None:
            todo.append(cause)
    return seen


def describe(exc: TransportError, config: EtcdConfig, endpoint: str) -> str:
    """One short reason for a transport failure, for a message that already names the endpoint."""
    if isinstance(exc, ConnectTimeout):
        return f"no connection within connect_timeout={config.connect_timeout:g}s"
    if isinstance(exc, ReadTimeout):
        return f"no answer within request_timeout={config.request_timeout:g}s"
    links = chain(exc)
    if (
        endpoint.startswith("https://")
        and isinstance(exc, ConnectFailed)
        and any(isinstance(link, ConnectionResetError) for link in links)
    ):
        # etcd's port multiplexer may answer a TLS hello on a plain-HTTP port by resetting the connection.
        return "connection reset during the TLS handshake: the server may not speak TLS (use http://)"
    for link in links:
        if isinstance(link, ssl.SSLCertVerificationError):
            return f"TLS certificate not trusted ({link.verify_message}): check cacert"
        if isinstance(link, ssl.SSLError):
            reason = str(link.reason or link)
            if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"):
                return "does not speak TLS: use http://"
            return f"TLS handshake failed: {reason}"
        if isinstance(link, ConnectionRefusedError):
            return "nothing listening (connection refused)"
        if isinstance(link, OSError) and link.strerror:
            return link.strerror
    text = str(exc)
    if "All connection attempts failed" in text or "Connection refused" in text:
        return "nothing listening (connection refused)"
    if isinstance(exc, ConnectFailed):
        return text or type(exc).__name__
    return f"connection lost ({text or type(exc).__name__})"


def was_sent(exc: TransportError) -> bool:
    """Whether the request may have reached the server (so repeating it may apply it twice)."""
    return not isinstance(exc, ConnectFailed)


class EndpointFailed(Exception):
    """This endpoint is unusable for this call; try the next (internal)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def http_error(endpoint: str, path: str, status: int, body: bytes) -> Exception:
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and "error" in obj and not isinstance(obj["error"], dict):
        code = int(obj.get("code") or 0)
        message = obj.get("message") or obj["error"]
        return EtcdRequestError(f"etcd at {endpoint}: {path}: {message} (code {code})", code=code)
    text = body.decode(errors="replace").strip().splitlines()[0] if body.strip() else ""
    if status == 400 and "HTTPS server" in text:
        return EndpointFailed("the server speaks TLS: use https://")
    if status == 404:
        return EndpointFailed(f"not an etcd v3 gateway (HTTP 404 for {path})")
    return EtcdRequestError(f"etcd at {endpoint}: {path}: HTTP {status} {text[:200]}")


def all_failed(failures: Sequence[tuple[str, str]], what: str) -> EtcdConnectionError:
    if len(failures) == 1:
        endpoint, reason = failures[0]
        return EtcdConnectionError(f"etcd at {endpoint}: {reason} ({what})")
    listed = "; ".join(f"{endpoint}: {reason}" for endpoint, reason in failures)
    return EtcdConnectionError(f"no etcd endpoint answered {what}: {listed}")


async def close_stack(stack: AsyncExitStack) -> None:
    with anyio.CancelScope(shield=True):
        with suppress(TransportError):  # closing a stream whose peer is already gone
            await stack.aclose()


class Stream:
    """One streaming call open on one member (:meth:`EtcdClient.open_stream`): its messages, one JSON object per
    line of the chunked answer."""

    def __init__(self, endpoint: str, lines: AsyncIterator[bytes], stack: AsyncExitStack, config: EtcdConfig) -> None:
        self.endpoint = endpoint
        self._lines = lines
        self._stack = stack
        self._config = config
        stack.push_async_callback(lines.aclose)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<Stream at {self.endpoint}>"

    async def receive(self) -> dict[str, Any]:
        """The next message's result.

        Raises:
            EtcdConnectionError: the member went away (the stream broke or ended, or the member is unavailable).
            EtcdRequestError: the member answered with an error.
        """
        try:
            return await self._next()
        except EndpointFailed as exc:
            raise EtcdConnectionError(f"etcd at {self.endpoint}: {exc.reason}") from None
        except ReadTimeout as exc:
            timeout = self._config.stream_timeout
            raise EtcdConnectionError(f"etcd at {self.endpoint}: no message within stream_timeout={timeout}s") from exc
        except TransportError as exc:
            reason = describe(exc, self._config, self.endpoint)
            raise EtcdConnectionError(f"etcd at {self.endpoint}: {reason}") from exc

    async def _next(self) -> dict[str, Any]:
        while True:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                raise EndpointFailed("the stream ended") from None
            if not line.strip():
                continue
            obj = json.loads(line)
            if "error" in obj:
                error = obj["error"]
                message = error.get("message") if isinstance(error, dict) else error
                code = int(error.get("grpc_code") or error.get("code") or 0) if isinstance(error, dict) else 0
                if code == UNAVAILABLE:  # the member is going away (its gateway lost its own gRPC server)
                    raise EndpointFailed(str(message))
                raise EtcdRequestError(f"etcd at {self.endpoint}: stream: {message}", code=code)
            result: dict[str, Any] = obj.get("result", {})
            return result

    async def aclose(self) -> None:
        """Close the stream; shielded from cancellation."""
        await close_stack(self._stack)
