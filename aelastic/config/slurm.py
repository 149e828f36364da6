"""The Slurm source: what ``aelastic run`` takes from a Slurm step when the user gave no flag for it.

Theory of operation: ``srun aelastic run --nproc-per-node 2 train.py`` starts one agent per node of the step.
torchrun reads no ``SLURM_*`` variable, so without flags each node runs its own world; here the step's variables
fill in what the user left out, each value on its own (a flag or a ``PET_*`` variable always wins):

==================  =============================================================================================
value               taken from
==================  =============================================================================================
``--nnodes``        ``SLURM_STEP_NUM_NODES`` (N:N). A one-node step stays standalone, as without Slurm.
``--rdzv-backend``  ``c10d``, unless any of --rdzv-backend/--rdzv-endpoint/--master-addr/--master-port/--standalone
                    is given.
``--rdzv-endpoint`` (c10d) the first node of ``SLURM_STEP_NODELIST`` (our own hostlist parser, no ``scontrol``);
                    the first node of ``SLURM_JOB_NODELIST`` where ``--nnodes`` asks for more nodes than the step
                    has (one step per node, the node-loss layout). Port ``15000 + SLURM_JOB_ID % 15000``: two jobs
                    sharing a node differ unless their ids are 15000 apart; below the kernel's ephemeral range.
                    (etcd, ``--rdzv-endpoint embedded``) the job's own etcd on those nodes (all of them, in the
                    nodelist's order), and ``--rdzv-conf etcd_port`` ``15000 + (2 * SLURM_JOB_ID) % 15000``.
``--rdzv-id``       ``slurm-<SLURM_JOB_ID>-<SLURM_RESTART_COUNT or 0>``: a requeued job (same job id, restart count
                    + 1) never meets its dead predecessor's rendezvous, whatever store outlived it (an etcd, an
                    ``aelastic store``).
``--nproc-per-node`` ``SLURM_GPUS_ON_NODE`` (the GPUs the step has on this node) when > 0; else the usual default
                    (1). Tasks per node are not workers: ``aelastic run`` is one task per node, so a step with more
                    tasks than nodes is refused (run ``srun --ntasks-per-node=1``).
==================  =============================================================================================

A step is told from a batch shell (or ``salloc``'s) by ``SLURM_STEP_ID``: the batch shell has no ``SLURM_STEP_*``
and runs on one node only, so nothing is derived there (a note says to use ``srun``). Every rule here is a pure
function of the environment but :func:`check_not_loopback`, which resolves a name.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from typing import Final, NamedTuple

from .._net import format_address
from ..errors import ConfigurationError
from .hostlist import expand_hostlist

__all__ = [
    "PORT_BASE",
    "PORT_SPAN",
    "Derived",
    "check_not_loopback",
    "check_one_task_per_node",
    "embedded",
    "endpoint",
    "etcd_port",
    "gpus_on_node",
    "in_batch_shell",
    "in_step",
    "run_id",
    "step_nodes",
]

PORT_BASE: Final = 15000
PORT_SPAN: Final = 15000  # ports 15000..29999: under Linux's ephemeral range (32768..)


class Derived(NamedTuple):
    """A value taken from Slurm and the variables it came from (``SLURM_STEP_NUM_NODES=2``)."""

    value: str
    source: str
    variable: str = ""  # for a host: the variable (and its text) it was read from


def in_step(environ: Mapping[str, str]) -> bool:
    """Inside a job step (``srun``): the step's variables are set."""
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" in environ


def in_batch_shell(environ: Mapping[str, str]) -> bool:
    """In a job's batch shell (or ``salloc``'s): a job, no step."""
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" not in environ


def _int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None or text == "":
        return None
    if not text.isdigit():
        raise ConfigurationError(f"{name}={text!r}: must be a non-negative integer (Slurm sets it)")
    return int(text)


def step_nodes(environ: Mapping[str, str]) -> Derived:
    """The step's node count: ``SLURM_STEP_NUM_NODES``, else the length of ``SLURM_STEP_NODELIST``."""
    count = _int(environ, "SLURM_STEP_NUM_NODES")
    if count is not None and count > 0:
        return Derived(str(count), f"SLURM_STEP_NUM_NODES={count}")
    text = environ.get("SLURM_STEP_NODELIST", "")
    hosts = expand_hostlist(text, "SLURM_STEP_NODELIST")
    return Derived(str(len(hosts)), f"SLURM_STEP_NODELIST={text}")


def check_one_task_per_node(environ: Mapping[str, str]) -> None:
    """``aelastic run`` is one task per node (it starts the node's workers); a step with more is refused."""
    tasks, nodes = _int(environ, "SLURM_STEP_NUM_TASKS"), _int(environ, "SLURM_STEP_NUM_NODES")
    if tasks is not None and nodes is not None and tasks > nodes:
        raise ConfigurationError(
            f"SLURM_STEP_NUM_TASKS={tasks} on SLURM_STEP_NUM_NODES={nodes}: aelastic run must be one task per node "
            "(it starts the node's workers itself); use 'srun --ntasks-per-node=1 aelastic run', or give --nnodes "
            "and --rdzv-* yourself"
        )


def run_id(environ: Mapping[str, str]) -> Derived:
    """``slurm-<job>-<restart count>``; see the module doc."""
    job = environ["SLURM_JOB_ID"]
    restarts = _int(environ, "SLURM_RESTART_COUNT") or 0
    shown = environ.get("SLURM_RESTART_COUNT", "unset")
    return Derived(f"slurm-{job}-{restarts}", f"SLURM_JOB_ID={job}, SLURM_RESTART_COUNT={shown}")


def job_port(environ: Mapping[str, str]) -> int:
    """``15000 + SLURM_JOB_ID % 15000``."""
    job = _int(environ, "SLURM_JOB_ID")
    if job is None:
        raise ConfigurationError("SLURM_JOB_ID='': Slurm sets it to the job's number")
    return PORT_BASE + job % PORT_SPAN


def _nodelist(environ: Mapping[str, str], max_nodes: int) -> tuple[str, str, list[str]]:
    """The step's nodes, or the job's where ``max_nodes`` is more than the step's (one step per node): the variable,
    its text and its hosts."""
    variable = "SLURM_STEP_NODELIST"
    step_count = len(expand_hostlist(environ.get(variable, ""), variable))
    if max_nodes > step_count and environ.get("SLURM_JOB_NODELIST"):
        variable = "SLURM_JOB_NODELIST"
    text = environ.get(variable, "")
    return variable, text, expand_hostlist(text, variable)


def endpoint(environ: Mapping[str, str], max_nodes: int) -> Derived:
    """The c10d store's ``HOST:PORT``: the first node of the step, or of the job where ``max_nodes`` is more than the
    step's nodes; port from the job id."""
    variable, text, hosts = _nodelist(environ, max_nodes)
    port = job_port(environ)
    return Derived(
        format_address(hosts[0], port),
        f"first node of {variable}={text}, port {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}",
        f"{variable}={text}",
    )


def embedded(environ: Mapping[str, str], max_nodes: int) -> Derived:
    """The job's own etcd (``--rdzv-endpoint embedded``): ``embedded:HOST,...`` over the nodes of the step, or of
    the job where ``max_nodes`` is more than the step's nodes. A batch node that only launches is among the job's:
    it starts no member, and the others replace it a few seconds on (:mod:`aelastic.etcd.embedded`)."""
    variable, text, hosts = _nodelist(environ, max_nodes)
    return Derived("embedded:" + ",".join(hosts), f"the nodes of {variable}={text}", f"{variable}={text}")


def etcd_port(environ: Mapping[str, str]) -> Derived:
    """The job's own etcd's client port, ``15000 + (2 * SLURM_JOB_ID) % 15000`` (its peers use the next one): two
    ports per job, so that jobs with neighbouring ids sharing a node differ."""
    job = _int(environ, "SLURM_JOB_ID")
    if job is None:
        raise ConfigurationError("SLURM_JOB_ID='': Slurm sets it to the job's number")
    port = PORT_BASE + (2 * job) % PORT_SPAN
    return Derived(str(port), f"{PORT_BASE} + (2 * SLURM_JOB_ID) % {PORT_SPAN}")


def gpus_on_node(environ: Mapping[str, str]) -> Derived | None:
    """``SLURM_GPUS_ON_NODE`` when > 0."""
    count = _int(environ, "SLURM_GPUS_ON_NODE")
    if not count:
        return None
    return Derived(str(count), f"SLURM_GPUS_ON_NODE={count}")


def check_not_loopback(host: str, source: str, max_nodes: int) -> None:
    """Refuse a rendezvous host that resolves to a loopback address where other nodes must reach it.

    A node's own name mapped to 127.0.1.1 (Debian's /etc/hosts) is the classic: the store's host would publish a
    loopback address as the workers' master address, and every other node would connect to itself.
    """
    if max_nodes <= 1:
        return
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return  # unresolvable here: the connection reports it, with the retries of the rendezvous
    addresses = {str(info[4][0]) for info in infos}
    loopback = sorted(a for a in addresses if ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if loopback:
        raise ConfigurationError(
            f"rendezvous host {host!r} (from {source}) resolves to loopback ({', '.join(loopback)}), but up to "
            f"{max_nodes} nodes must reach it: fix its /etc/hosts entry or give --rdzv-endpoint ADDR:PORT"
        )
