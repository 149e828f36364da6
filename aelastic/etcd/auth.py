"""The job's own etcd's authentication (:mod:`.embedded`): the password of its user ``root``, derived from the job's
token, and what a refusal of it means for a node."""

from __future__ import annotations

import hashlib
import hmac

from ..errors import ConfigurationError, EtcdRequestError
from ..store.auth import AUTH_TOKEN_ENV

__all__ = ["refused", "root_password"]


def root_password(token: str, run_id: str) -> str:
    """The password of the job's etcd's user ``root``, derived from the job's token (every node derives it alike;
    the token itself never reaches etcd, and another run's password differs)."""
    return hmac.new(token.encode(), f"aelastic job etcd {run_id}".encode(), hashlib.sha256).hexdigest()


def refused(exc: EtcdRequestError, password: str | None) -> Exception:
    """What a refusal of the job's etcd means for this node: a token it lacks, or one that differs."""
    token = f"the job's token ({AUTH_TOKEN_ENV} or --rdzv-conf auth_token)"
    if "user name is empty" in str(exc) and password is None:
        return ConfigurationError(f"the job's etcd refused this node: it requires {token}, which this node lacks")
    if "invalid user ID or password" in str(exc):
        return ConfigurationError(f"the job's etcd refused this node: {token} differs from the one it was secured with")
    return exc
