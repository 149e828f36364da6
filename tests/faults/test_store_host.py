"""The host that serves the rendezvous dies: fatal on c10d (a documented limit), survivable on etcd.

A host dies two ways: its processes crash while its kernel lives on (peers get connection resets at once), or it
loses power (``silent``: the link goes down first, so peers hear nothing and their packets vanish).
"""

from __future__ import annotations

import time

import pytest

from aelastic.etcd.server import find_etcd_binary

from .conftest import C10D_PORT, FAST_CONF, Cluster, report_time

pytestmark = [pytest.mark.faults, pytest.mark.torch]

ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
STORE_LOST = 10.0  # read_timeout: how long a node may go without reaching the store before it gives up
# How long the survivors get to fail (c10d) or recover (etcd): generous, yet far below TCP's or gloo's timeouts.
VERDICT = 30.0


crash_or_silent = pytest.mark.parametrize(
    "silent", [pytest.param(False, id="crash"), pytest.param(True, id="power-off")]
)


@crash_or_silent
def test_c10d_store_host_death_fails_the_job_naming_the_store(cluster: Cluster, silent: bool) -> None:
    survivors, took = cluster.store_host_dies(silent=silent, store_lost=STORE_LOST, verdict=VERDICT)
    kind = "silent" if silent else "crash"
    report_time(f"c10d store host dies ({kind}): job fails", took, "both survivors exited with an error")
    store = f"{cluster.hosts[0].addr}:{C10D_PORT}"
    for agent in survivors:
        last = agent.output.strip().splitlines()[-1]
        assert last.startswith("aelastic run: error:"), agent.output
        assert store in last, agent.output


def start_etcd(cluster: Cluster) -> str:
    """One etcd member per host, on the host's address; returns the client endpoints for --rdzv-endpoint."""
    binary = find_etcd_binary()
    peers = ",".join(f"{h.name}=http://{h.addr}:{ETCD_PEER_PORT}" for h in cluster.hosts)
    members = []
    for h in cluster.hosts:
        client, peer = f"http://{h.addr}:{ETCD_CLIENT_PORT}", f"http://{h.addr}:{ETCD_PEER_PORT}"
        command = [
            binary, "--name", h.name, "--data-dir", h.dir / "etcd",
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", peers, "--initial-cluster-state", "new",
            "--initial-cluster-token", cluster.tag, "--unsafe-no-fsync",
        ]  # fmt: skip
        members.append(cluster.spawn(h, *command, log="etcd"))
    for member in members:
        cluster.wait_for(f"etcd on {member.host.name}", lambda m=member: "ready to serve client requests" in m.output)
    return ",".join(f"{h.addr}:{ETCD_CLIENT_PORT}" for h in cluster.hosts)


@crash_or_silent
def test_etcd_member_host_death_is_survived(cluster: Cluster, silent: bool) -> None:
    h0, h1, h2 = cluster.hosts
    endpoint = start_etcd(cluster)
    # Every agent lists h0's member first, so both survivors talk to the member that dies. Restarts are allowed:
    # survivors' workers may see the dead peer before the heartbeats do.
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", "faults", "--rdzv-conf", FAST_CONF]
    agents = [
        cluster.agent(h, nnodes="2:3", rdzv=rdzv, backend=b, log_level="WARNING", max_restarts=3)
        for h, b in zip(cluster.hosts, ("trio", "asyncio", "trio"), strict=True)
    ]
    first = cluster.wait_training(cluster.hosts, 3)
    # A node that joins more than the last call after the other two makes the world of three a second round: the
    # workers of the first one are old too, and restarts count from the world of three.
    old = cluster.records()
    died = time.time()
    cluster.kill_host(h0, silent=silent)
    after = cluster.wait_training([h1, h2], 2, old=old, timeout=VERDICT)
    kind = "silent" if silent else "crash"
    report_time(f"etcd member host dies ({kind}): survivors training", time.time() - died, "survivors all-reduce")
    # A crash reaches the survivors' workers first (gloo sees the peer's connection close): a failure restart; a
    # silent death reaches the heartbeats first: a membership restart. One restart either way.
    assert {sum(after[h]["round"]) - sum(first[h]["round"]) for h in after} == {1}, (first, after)
    assert all(a.running() for a in agents[1:]), cluster.logs()
