"""The ``slurm_cluster`` fixture: a real Slurm cluster (Debian's 22.05) in network namespaces, one per test module.

How it is built and torn down: :mod:`tests.slurm.cluster`. A test module sets its shape with module attributes::

    SLURM_NODES = 3  # nodes node1..node3 (default 2)
    SLURM_GPUS = 2  # gres/gpu per node, fake devices (default 0)
    SLURM_CPUS = 2  # CPUs each node declares (default 1)
    SLURM_PRIVATE_SHM = True  # each node a /dev/shm of its own, gone with the node (default: the machine's)

and uses the cluster as a user of it would::

    def test_two_nodes(slurm_cluster):
        assert slurm_cluster.srun("-N2", "hostname").stdout.split() == ["node1", "node2"]

Skipped, saying why, only where a cluster cannot be built: not root, no iproute2/util-linux, no network namespaces,
or Slurm is missing and ``apt-get install -y --no-install-recommends slurmctld slurmd slurm-client`` fails (the
fixture tries it once per session; ``AELASTIC_SLURM_INSTALL=0`` turns the attempt off and skips instead).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from .cluster import SlurmCluster, ensure_slurm

_why_not: list[str | None] = []  # ensure_slurm's answer, asked once per session


def slurm_unavailable() -> str | None:
    if not _why_not:
        _why_not.append(ensure_slurm(install=os.environ.get("AELASTIC_SLURM_INSTALL", "1") != "0"))
    return _why_not[0]


@pytest.fixture(scope="module")
def slurm_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A started cluster, every node idle; torn down after the module (also on failure), and the teardown must
    leave nothing behind. ``cluster.timings`` holds the seconds it took to come up and to go down."""
    why = slurm_unavailable()
    if why is not None:
        pytest.skip(why)
    size = getattr(request.module, "SLURM_NODES", 2)
    gpus = getattr(request.module, "SLURM_GPUS", 0)
    cpus = getattr(request.module, "SLURM_CPUS", 1)
    private_shm = getattr(request.module, "SLURM_PRIVATE_SHM", False)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), size, cpus=cpus, gpus=gpus, private_shm=private_shm)
    left: list[str] = []
    try:
        start = time.monotonic()
        cluster.start()
        cluster.timings["up"] = time.monotonic() - start
        print(f"[slurm] {cluster!r}: up (every node idle) in {cluster.timings['up']:.2f} s")
        yield cluster
    finally:
        start = time.monotonic()
        left = cluster.teardown()
        cluster.timings["down"] = time.monotonic() - start
        print(f"[slurm] {cluster!r}: torn down in {cluster.timings['down']:.2f} s; left behind: {left or 'nothing'}")
    assert not left, f"the Slurm cluster's teardown left {left}"
