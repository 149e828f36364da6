"""The public surfaces of aelastic's packages, pinned: torch's names where aelastic has them (issue 14, item 2),
so that code written for ``torch.distributed.elastic`` changes only its import line; and none of them makes
``import aelastic`` (or a callable worker's bootstrap) import anyio or torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

# torch.distributed.elastic.rendezvous.__all__ (torch 2.13) without its handler registry (RendezvousHandlerCreator,
# RendezvousHandlerRegistry, rendezvous_handler_registry): aelastic's is register_backend/open_rendezvous.
TORCH_RENDEZVOUS = {
    "RendezvousClosedError", "RendezvousConnectionError", "RendezvousError", "RendezvousGracefulExitError",
    "RendezvousHandler", "RendezvousInfo", "RendezvousParameters", "RendezvousStateError", "RendezvousStoreInfo",
    "RendezvousTimeoutError",
}  # fmt: skip
# torch.distributed.elastic.agent.server and .multiprocessing(.errors) names aelastic has.
TORCH_AGENT = {
    "ElasticAgent", "RunResult", "Worker", "WorkerGroup", "WorkerSpec", "WorkerState",
    "ChildFailedError", "ProcessFailure", "record", "Std",
}  # fmt: skip
# torch.distributed's store classes aelastic has (its TCPStore client is StoreClient).
TORCH_STORE = {"PrefixStore", "Store"}

# The top-level package: the launcher's names and the error tree's (torch's LaunchConfig, elastic_launch's
# ChildFailedError/record, RunResult/WorkerSpec/WorkerState), and aelastic's own.
AELASTIC = {
    "AelasticError", "ChildFailedError", "ConfigurationError", "LaunchConfig", "LaunchControl", "ProcessFailure",
    "QueueEmptyError", "RendezvousClosedError", "RendezvousConnectionError", "RendezvousError",
    "RendezvousGracefulExitError", "RendezvousStateError", "RendezvousTimeoutError", "RunResult",
    "StoreConnectionError", "StoreError", "StoreProtocolError", "WorkerSpec", "WorkerState", "__version__", "launch",
    "record", "run",
    # How a job ends, beyond torch's (issue 31): its failure elsewhere, no progress, a worker SIGKILL does not end.
    "FailedElsewhereError", "NoProgressError", "NodeCheckError", "UnkillableWorkerError",
    # aelastic's options, one record per feature (issue 44).
    "CheckpointOptions", "LogOptions", "NodeCheckOptions", "PrewarmOptions", "RestartOptions", "Timeouts",
}  # fmt: skip
ETCD = {
    "Compare", "DeleteOp", "EtcdClient", "EtcdClientStatistics", "EtcdConfig", "EtcdStore", "EventType", "KeyValue",
    "Lease", "LocalEtcd", "LocalEtcdMember", "PutOp", "RaftTiming", "RangeOp", "SortOrder", "SortTarget", "Watch",
    "WatchEvent", "find_etcd_binary", "open_etcd_client", "open_local_etcd", "open_local_etcd_cluster",
    "parse_endpoints", "prefix_range_end",
}  # fmt: skip

# The rendezvous backend protocol, public for third-party backends (register_backend), and the conformance kit
# they can run against it (aelastic's own conformance suite runs the same checks).
RENDEZVOUS_BACKENDS = {"Digest", "DigestRead", "RendezvousBackend", "StateReader", "Versioned"}
RENDEZVOUS_TESTING = {
    "CHECKS", "FAST", "BackendUnderTest", "Cluster", "Node", "assert_consistent", "check_barrier_blocks_until_min",
    "check_close_reaches_members_and_later_joiners", "check_completes_after_last_call_below_max",
    "check_completes_at_once_at_max", "check_fast_quorum_false_keeps_the_last_call",
    "check_join_timeout_when_min_never_reached", "check_regroups_after_a_loss_without_the_last_call",
    "check_late_node_waits_and_joins_next_round", "check_member_death_after_completion_is_detected",
    "check_member_that_finished_may_leave", "check_member_that_leaves_for_good_is_regrouped_without",
    "check_node_dying_before_completion_is_dropped",
    "check_reserve_nodes_exit_gracefully_on_close", "check_survivors_keep_rank_order",
    "check_workers_store_is_served_by_rank_0_fresh_each_round", "open_cluster", "wait_done",
}  # fmt: skip

SURFACES = {
    "aelastic": AELASTIC,
    "aelastic.rendezvous.backends": RENDEZVOUS_BACKENDS,
    "aelastic.rendezvous.testing": RENDEZVOUS_TESTING,
    "aelastic.etcd": ETCD,
    # In-memory checkpoints, the worker's side (issue 29).
    "aelastic.checkpoint": {
        "CheckpointError", "LoadInfo", "SavePlanner", "StorageReader", "StorageWriter", "available", "last_loaded",
        "load", "save", "step_to_restore",
    },
    "aelastic.rendezvous": TORCH_RENDEZVOUS | {"check_parameters", "open_rendezvous", "register_backend"},
    "aelastic.agent": TORCH_AGENT,
    "aelastic.store": TORCH_STORE | {
        "QueueEmptyError", "ServerSettings", "ServerStatistics", "StoreAuthError", "StoreBindError", "StoreClient",
        "StoreConnectionError", "StoreError", "StoreProtocolError", "StoreServer", "open_store_client",
        "open_store_server", "serve_store",
    },
}  # fmt: skip


@pytest.mark.parametrize("package", sorted(SURFACES))
def test_package_exports_exactly_its_pinned_names_and_each_resolves(package: str) -> None:
    module = importlib.import_module(package)
    assert set(module.__all__) == SURFACES[package]
    assert sorted(module.__all__) == module.__all__  # kept sorted, as aelastic's own
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(dir(module)) >= SURFACES[package]


def test_torchs_rendezvous_import_line_works_with_aelastic() -> None:
    from aelastic.rendezvous import RendezvousHandler, RendezvousParameters, RendezvousTimeoutError

    params = RendezvousParameters("c10d", "localhost:29400", "job", 1, 2, join_timeout=5)
    assert (params.min_nodes, params.max_nodes, params.config) == (1, 2, {"join_timeout": 5})
    assert issubclass(RendezvousTimeoutError, Exception)
    assert isinstance(RendezvousHandler, type)


def test_names_are_the_same_objects_as_in_their_modules() -> None:
    from aelastic import agent, errors, rendezvous, store
    from aelastic.agent import agent as agent_module
    from aelastic.rendezvous import api
    from aelastic.store import server

    assert rendezvous.RendezvousParameters is api.RendezvousParameters
    assert rendezvous.RendezvousTimeoutError is errors.RendezvousTimeoutError
    assert store.open_store_server is server.open_store_server
    assert agent.ElasticAgent is agent_module.ElasticAgent


def test_importing_the_packages_loads_neither_anyio_nor_torch() -> None:
    code = (
        "import sys, aelastic, aelastic.agent, aelastic.rendezvous, aelastic.store, aelastic.checkpoint\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('anyio', 'torch', 'trio', 'h11')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
