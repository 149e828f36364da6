"""aelastic: an asyncio/trio-native elastic launcher for PyTorch distributed jobs."""

from __future__ import annotations

from .errors import (
    AelasticError,
    ConfigurationError,
    QueueEmptyError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
)

__version__ = "0.1.0"

__all__ = [
    "AelasticError",
    "ConfigurationError",
    "QueueEmptyError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StoreConnectionError",
    "StoreError",
    "StoreProtocolError",
    "__version__",
]
