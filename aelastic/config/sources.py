"""Where each value of ``aelastic run`` comes from: a flag, a ``PET_*`` variable, a Slurm variable or a default.

Theory of operation: the command line records the flags given on it (``args.flags_given``, the dest and the option
as typed, by the recording actions of ``aelastic.cli``); argparse already put ``PET_<DEST>`` in as the default of
each flag. :func:`apply_slurm` then fills in, from a Slurm step (:mod:`.slurm`), what neither gave, and returns one
line saying what it derived from which variable and which flag won over a Slurm variable. :func:`describe` is
``--dry-run``'s table: every field of the resolved :class:`LaunchConfig` with its value and its source.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from .._net import parse_endpoint
from . import slurm
from .flags import flags
from .launch_config import LaunchConfig
from .values import parse_nnodes, parse_rdzv_conf

__all__ = ["apply_slurm", "describe", "given", "sources"]

# The flags that name the rendezvous: any one given and the Slurm source leaves the backend and the endpoint alone.
_RDZV_DESTS = ("rdzv_backend", "rdzv_endpoint", "master_addr", "master_port", "standalone")

# LaunchConfig fields set from a flag the table does not name as theirs.
_FIELD_DEST = {
    "min_nodes": "nnodes", "max_nodes": "nnodes", "run_id": "rdzv_id", "rdzv_configs": "rdzv_conf",
    "shutdown_grace": "shutdown_timeout", **{flag.field: flag.dest for flag in flags() if flag.field is not None},
}  # fmt: skip
# Fields that read a variable of torch's where no flag is given.
_FIELD_ENV = {
    "log_line_prefix_template": "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
    "shutdown_grace": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
}


def given(args: argparse.Namespace, dest: str, environ: Mapping[str, str]) -> str | None:
    """The flag (as typed) or the ``PET_*`` variable that gave ``dest``; None where it is the default."""
    flags: Mapping[str, str] = getattr(args, "flags_given", {})
    if dest in flags:
        return f"flag {flags[dest]}"
    if f"PET_{dest.upper()}" in environ:
        return f"PET_{dest.upper()}"
    return None


def apply_slurm(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[argparse.Namespace, dict[str, str], str]:
    """``args`` with what a Slurm step says filled in where no flag or ``PET_*`` variable gave it (see
    :mod:`.slurm`), the source of each value derived (by dest), and the line to log ('' when there is nothing to
    say).

    Raises:
        ConfigurationError: a malformed Slurm variable (a hostlist, a count), more tasks than nodes in the step, or a
            rendezvous host that resolves to a loopback address although other nodes must reach it.
    """
    if not slurm.in_step(environ):
        if slurm.in_batch_shell(environ) and environ.get("SLURM_JOB_NUM_NODES", "1") != "1":
            note = (
                f"Slurm batch shell of job {environ['SLURM_JOB_ID']} (no SLURM_STEP_ID): this agent runs on this "
                "node only; 'srun aelastic run ...' starts one on every node of the job"
            )
            return args, {}, note
        return args, {}, ""
    d = _Derivation(argparse.Namespace(**vars(args)), environ)
    args = d.args
    step = slurm.step_nodes(environ)
    nnodes_flag = given(args, "nnodes", environ)
    if nnodes_flag is None:
        slurm.check_one_task_per_node(environ)
        d.take("nnodes", step, "--nnodes")
    else:
        low, high = parse_nnodes(args.nnodes)
        if not low <= int(step.value) <= high:
            d.overruled.append(f"{nnodes_flag} {args.nnodes} wins over {step.source}")
    max_nodes = parse_nnodes(args.nnodes)[1]
    host_from = ""
    if max_nodes > 1:
        host_from = _slurm_rendezvous(d, max_nodes)
    elif nnodes_flag is None:
        d.said.append("one node: standalone")
    gpus = slurm.gpus_on_node(environ)
    nproc_flag = given(args, "nproc_per_node", environ)
    if gpus is not None and nproc_flag is None:
        d.take("nproc_per_node", gpus, "--nproc-per-node")
    elif gpus is not None and str(args.nproc_per_node) not in (gpus.value, "gpu", "auto"):
        d.overruled.append(f"{nproc_flag} {args.nproc_per_node} wins over {gpus.source}")
    _check_endpoint(args, environ, host_from, max_nodes, int(step.value))
    return args, d.derived, d.line()


class _Derivation:
    """What the Slurm source derives: the arguments it changes, each value's source, and what it says."""

    def __init__(self, args: argparse.Namespace, environ: Mapping[str, str]) -> None:
        self.args = args
        self.environ = environ
        self.derived: dict[str, str] = {}
        self.said: list[str] = []
        self.overruled: list[str] = []

    def take(self, dest: str, value: slurm.Derived, what: str) -> None:
        setattr(self.args, dest, value.value)
        self.derived[dest] = value.source
        self.said.append(f"{what} {value.value} ({value.source})")

    def line(self) -> str:
        if not self.said and not self.overruled:
            return ""
        where = f"Slurm step {self.environ['SLURM_JOB_ID']}.{self.environ['SLURM_STEP_ID']}"
        line = f"{where}: " + "; ".join(self.said) if self.said else f"{where}: nothing derived"
        if self.overruled:
            line += "; flags win: " + "; ".join(self.overruled)
        return line


def _slurm_rendezvous(d: _Derivation, max_nodes: int) -> str:
    """The rendezvous of a job of several nodes, where no flag names it; the variable the endpoint's host came from
    ('' where none did)."""
    args, environ = d.args, d.environ
    host_from = ""
    rdzv_given = [k for k in _RDZV_DESTS if given(args, k, environ) is not None and getattr(args, k) is not False]
    if not rdzv_given:
        args.rdzv_backend = "c10d"
        d.derived["rdzv_backend"] = f"Slurm step (SLURM_STEP_ID={environ['SLURM_STEP_ID']})"
        d.said.append("--rdzv-backend c10d")
    if args.rdzv_backend == "c10d" and given(args, "rdzv_endpoint", environ) is None:
        store = slurm.endpoint(environ, max_nodes)
        d.take("rdzv_endpoint", store, "--rdzv-endpoint")
        host_from = store.variable
    if args.rdzv_backend in ("etcd", "etcd-v2") and _embedded(args.rdzv_endpoint):
        if ":" not in args.rdzv_endpoint:
            d.take("rdzv_endpoint", slurm.embedded(environ, max_nodes), "--rdzv-endpoint")
        if "etcd_port" not in parse_rdzv_conf(args.rdzv_conf):
            port = slurm.etcd_port(environ)
            args.rdzv_conf = ",".join(filter(None, (args.rdzv_conf, f"etcd_port={port.value}")))
            d.derived["rdzv_conf"] = f"etcd_port from {port.source}"
            d.said.append(f"--rdzv-conf etcd_port={port.value} ({port.source})")
    if given(args, "rdzv_id", environ) is None:
        d.take("rdzv_id", slurm.run_id(environ), "--rdzv-id")
    return host_from


def _embedded(endpoint: str) -> bool:
    """Whether ``endpoint`` names the job's own etcd (``embedded[:HOST,...]``). Its module is imported only here,
    for an etcd run: a c10d run imports nothing of the etcd driver."""
    from ..etcd.layout import EMBEDDED

    return endpoint.partition(":")[0] == EMBEDDED


def _check_endpoint(
    args: argparse.Namespace, environ: Mapping[str, str], host_from: str, max_nodes: int, step_nodes: int
) -> None:
    """The loopback rule, for a host Slurm gave, or any c10d host of a step that spans several nodes (whose other
    agents are on other hosts, whatever the flags say)."""
    if args.rdzv_backend != "c10d" or not args.rdzv_endpoint or args.rdzv_endpoint.startswith("etcd://"):
        return
    source = host_from or given(args, "rdzv_endpoint", environ)
    if not host_from and step_nodes <= 1:
        return
    host, _ = parse_endpoint(args.rdzv_endpoint, 0)
    slurm.check_not_loopback(host, str(source), max_nodes)


def sources(
    config: LaunchConfig, args: argparse.Namespace, environ: Mapping[str, str], derived: Mapping[str, str]
) -> dict[str, str]:
    """Each LaunchConfig field's source: ``flag --X``, ``PET_X``, a Slurm variable, a variable of torch's,
    ``--standalone``, or ``default``."""
    standalone = (
        config.rdzv_endpoint == "localhost:0"
        and config.rdzv_backend == "c10d"
        and not any(given(args, d, environ) for d in ("rdzv_endpoint", "rdzv_backend"))
        and "rdzv_backend" not in derived
    )
    out: dict[str, str] = {}
    for name in config.flat():
        dest = _FIELD_DEST.get(name, name)
        if standalone and name in ("rdzv_backend", "rdzv_endpoint", "run_id"):
            why = given(args, "standalone", environ)
            out[name] = f"standalone ({why})" if why else "standalone (one node, no endpoint: torch 2.14's rule)"
            continue
        if name == "rdzv_endpoint" and args.rdzv_backend == "static" and not args.rdzv_endpoint:
            parts = [given(args, d, environ) or f"default {d}" for d in ("master_addr", "master_port")]
            out[name] = "static: " + ", ".join(parts)
            continue
        source = derived.get(dest) or (given(args, dest, environ) if hasattr(args, dest) else None)
        env = _FIELD_ENV.get(name)
        if source is None and env is not None and env in environ:
            source = env
        out[name] = source or "default"
    return out


def describe(config: LaunchConfig, entrypoint: Any, script_args: list[str], source: Mapping[str, str]) -> str:
    """``--dry-run``'s table: one line per field, ``name value  <- source``; then the workers' command."""
    rows = [(name, repr(value), source.get(name, "")) for name, value in config.flat().items()]
    name = entrypoint if isinstance(entrypoint, str) else f"{entrypoint.__module__}.{entrypoint.__qualname__}"
    rows.append(("workers run", " ".join([name, *script_args]), "training script and its arguments"))
    width = max(len(r[0]) for r in rows)
    value_width = min(40, max(len(r[1]) for r in rows))
    lines = ["aelastic run --dry-run: the resolved configuration (nothing started)"]
    lines += [f"  {n:<{width}}  {v:<{value_width}}  <- {s}" for n, v, s in rows]
    return "\n".join(lines)
