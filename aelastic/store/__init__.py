"""The key-value store: torch's TCPStore protocol served and spoken from an event loop.

Exports torch's ``torch.distributed`` store names that aelastic has (``Store``, ``PrefixStore``; the TCPStore
client is :class:`StoreClient`, opened with :func:`open_store_client`), the server, and the store errors; the
modules are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ..errors import (
    QueueEmptyError,
    StoreAuthError,
    StoreBindError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
)

if TYPE_CHECKING:
    from .api import PrefixStore, Store
    from .client import StoreClient, open_store_client
    from .server import ServerSettings, ServerStatistics, StoreServer, open_store_server, serve_store

_LAZY = {
    "PrefixStore": ".api",
    "Store": ".api",
    "StoreClient": ".client",
    "open_store_client": ".client",
    "ServerSettings": ".server",
    "ServerStatistics": ".server",
    "StoreServer": ".server",
    "open_store_server": ".server",
    "serve_store": ".server",
}

__all__ = [
    "PrefixStore",
    "QueueEmptyError",
    "ServerSettings",
    "ServerStatistics",
    "Store",
    "StoreAuthError",
    "StoreBindError",
    "StoreClient",
    "StoreConnectionError",
    "StoreError",
    "StoreProtocolError",
    "StoreServer",
    "open_store_client",
    "open_store_server",
    "serve_store",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
