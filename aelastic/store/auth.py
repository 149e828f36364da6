"""The optional shared token that lets aelastic's own nodes refuse strangers on the rendezvous store.

Theory of operation
-------------------
torch's TCPStore protocol has no authentication, so the token travels as an ordinary request that every server
understands: right after VALIDATE, an aelastic client sends ``CHECK([AUTH_KEY_PREFIX + token])`` (with an empty
token when it has none), pipelined with its PING, so the handshake costs no extra round trip.

* A server configured with a token (``ServerSettings.auth_token``) serves a connection only after VALIDATE and
  then that CHECK with the same token (compared in constant time). It answers a right token ``READY``; a wrong or
  missing token ``NOT_READY``, after which it closes the connection; any other request in that place (torch's
  client sends PING) closes the connection at once. The handshake timeout covers the token too, and the token is
  never stored: it is not a key of the table.
* A server without a token (aelastic's, or torch's own) treats the CHECK as any other: the reserved key does not
  exist (torch's clients prefix every key with ``/``; the prefix starts with a NUL byte), so it answers
  ``NOT_READY`` and goes on serving.
* So a client learns which case it is in from the replies: ``READY`` (admitted by token); ``NOT_READY`` and then
  the PING's reply (the server checks no token); ``NOT_READY`` and then the connection closed (refused:
  :class:`~aelastic.errors.StoreAuthError`, not retried).

Where it applies, and what it does not do
-----------------------------------------
``--rdzv-conf auth_token=...`` (or the ``AELASTIC_AUTH_TOKEN`` environment variable; the conf key wins) protects
the *rendezvous* store of the c10d backend: the hosting node's server refuses clients without the token, and every
other node presents it. Give every node the same token. (A dedicated store started with ``aelastic store``, and
the static backend's store, take no token yet.)

The *workers'* store (the bootstrap store that ``init_process_group("env://")`` reaches through ``MASTER_ADDR`` /
``MASTER_PORT`` with ``TORCHELASTIC_USE_AGENT_STORE=True``) carries no token: torch's C++ client cannot send one,
and refusing it would break every worker. That store is a separate server for each round
(:mod:`aelastic.rendezvous.bootstrap`): a fresh kernel-chosen port, bound only to the serving node's own address,
published only through the (token-protected) rendezvous store, stopped when the next round completes, and held to
the same limits as every server (handshake timeout, connection cap, key/value/buffer sizes). A stranger who finds
that port during a round can still read and write the workers' keys (gloo/NCCL addresses), as with torchrun; the
token does not prevent that, and only network isolation does.

The token is not encryption: it crosses the network in the clear. It keeps port scanners, misdirected jobs and
nodes of another run off the rendezvous store; it does not stop someone who can read the traffic.
"""

from __future__ import annotations

import os
from typing import Final

from ..errors import ConfigurationError
from . import wire

__all__ = [
    "AUTH_KEY_PREFIX",
    "AUTH_TOKEN_ENV",
    "MAX_TOKEN_BYTES",
    "check_token",
    "is_token_request",
    "resolve_auth_token",
    "token_matches",
    "token_request",
]

AUTH_KEY_PREFIX: Final = b"\x00aelastic/auth\x00"
AUTH_TOKEN_ENV: Final = "AELASTIC_AUTH_TOKEN"
MAX_TOKEN_BYTES: Final = 1024


def check_token(token: str, *, what: str = "auth_token") -> str:
    """``token`` if it can be a token (1..1024 bytes of UTF-8), else a :class:`ConfigurationError`."""
    size = len(token.encode())
    if not 1 <= size <= MAX_TOKEN_BYTES:
        raise ConfigurationError(f"{what}: a token of {size} bytes; it must be 1..{MAX_TOKEN_BYTES} bytes")
    return token


def resolve_auth_token(configured: str | None) -> str | None:
    """The token to use: ``configured`` (``--rdzv-conf auth_token``), else ``$AELASTIC_AUTH_TOKEN``, else none."""
    if configured is not None:
        return check_token(configured, what="--rdzv-conf auth_token")
    from_env = os.environ.get(AUTH_TOKEN_ENV)
    return check_token(from_env, what=AUTH_TOKEN_ENV) if from_env else None


def token_request(token: str | None) -> wire.Check:
    """The CHECK a client sends after VALIDATE (an empty token when it has none)."""
    return wire.Check((AUTH_KEY_PREFIX + (token or "").encode(),))


def is_token_request(request: wire.Request) -> bool:
    return isinstance(request, wire.Check) and len(request.keys) == 1 and request.keys[0].startswith(AUTH_KEY_PREFIX)


def token_matches(request: wire.Check, token: bytes) -> bool:
    """Whether the token CHECK ``request`` carries ``token`` (constant time in the token's content)."""
    import hmac  # here, not at the top: it loads OpenSSL's hashlib, which a store without a token never needs

    return hmac.compare_digest(request.keys[0][len(AUTH_KEY_PREFIX) :], token)
