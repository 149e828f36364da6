"""``aelastic run``'s arguments into a checked :class:`RunCommand`: a LaunchConfig and the workers' command.

Theory of operation: argparse (``aelastic.cli``) hands over the flags as text (a few torchrun already types:
``--max-restarts`` an int); :func:`config_from_args` converts each with :mod:`.values`, maps torch's legacy
``etcd://`` URL, applies the standalone defaults (``--standalone``, and torch 2.14's automatic standalone), loads
the plugins a flag names (a ``--logs-specs`` class, an event handler, the metrics endpoint's dependency), checks
the rendezvous parameters as opening them would, and resolves the script. Every rule is checked before anything
changes: a refused command line leaves no trace but its one-line error. Nothing here writes the process
environment: :func:`.environ.export_run_environment` does, once the caller has accepted the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .._net import format_address
from ..errors import ConfigurationError
from ..events import check_event_handler
from ..rendezvous.api import RendezvousParameters
from ..rendezvous.registry import check_parameters
from . import environ
from .extras import check_metrics_available
from .flags import flags
from .launch_config import LaunchConfig
from .sources import apply_slurm, sources
from .values import (
    check_at_least,
    check_node_check,
    check_writable_dir,
    new_run_id,
    parse_nnodes,
    parse_nproc,
    parse_rdzv_conf,
    parse_signals,
    resolve_forwarded,
)

__all__ = ["Resolved", "RunCommand", "config_from_args", "resolve", "run_script_path"]

logger = logging.getLogger(__name__)

Entrypoint = str | Callable[..., Any]


class RunCommand(NamedTuple):
    """What ``aelastic run`` launches: ``launch(config, entrypoint, *args)``."""

    config: LaunchConfig
    entrypoint: Entrypoint
    args: list[str]


class Resolved(NamedTuple):
    """A command line resolved: the command, each LaunchConfig field's source (``--dry-run`` prints both), and the
    Slurm source's line ('' where it has nothing to say)."""

    command: RunCommand
    sources: dict[str, str]
    slurm_line: str


class _Rendezvous(NamedTuple):
    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    configs: dict[str, Any]


def run_script_path(script: str, *args: str) -> None:
    """``--run-path``: run the script in the worker with runpy, as torch's ``run_script_path``."""
    import runpy

    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def _legacy_url(args: argparse.Namespace, rdzv: _Rendezvous) -> _Rendezvous:
    """torch's legacy ``etcd://`` URL names the endpoint, the run id, the node counts and the timeouts; --rdzv-conf
    keys given beside it win, a different --rdzv-id or --nnodes is refused."""
    endpoint = rdzv.endpoint
    if rdzv.backend not in ("etcd", "etcd-v2"):
        raise ConfigurationError(f"--rdzv-endpoint {endpoint!r}: an etcd:// URL needs --rdzv-backend etcd")
    legacy = RendezvousParameters.from_url(endpoint)
    if rdzv.run_id not in ("none", legacy.run_id):
        raise ConfigurationError(f"--rdzv-id {rdzv.run_id!r}: the URL {endpoint!r} names the run {legacy.run_id!r}")
    if args.nnodes != "1:1" and (rdzv.min_nodes, rdzv.max_nodes) != (legacy.min_nodes, legacy.max_nodes):
        raise ConfigurationError(f"--nnodes {args.nnodes!r}: the URL {endpoint!r} gives the node counts")
    configs = {**legacy.config, **rdzv.configs}
    return _Rendezvous(rdzv.backend, legacy.endpoint, legacy.run_id, legacy.min_nodes, legacy.max_nodes, configs)


def _rendezvous(args: argparse.Namespace) -> _Rendezvous:
    """The rendezvous flags after the legacy URL and the standalone defaults."""
    rdzv = _Rendezvous(
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, *parse_nnodes(args.nnodes), parse_rdzv_conf(args.rdzv_conf)
    )
    if rdzv.endpoint.startswith("etcd://"):
        rdzv = _legacy_url(args, rdzv)
    backend, endpoint = rdzv.backend, rdzv.endpoint
    auto_standalone = backend == "static" and not endpoint and args.master_port is None and rdzv.max_nodes == 1
    if args.standalone or auto_standalone:
        return rdzv._replace(backend="c10d", endpoint="localhost:0", run_id=new_run_id())
    if backend == "static":
        rdzv.configs["rank"] = args.node_rank
        if not endpoint:
            endpoint = format_address(args.master_addr.strip("[]"), args.master_port or 29500)
    if not endpoint and backend != "c10d":
        raise ConfigurationError(f"--rdzv-endpoint '': the {backend!r} backend needs HOST[:PORT]")
    return rdzv._replace(endpoint=endpoint)


def _entrypoint(args: argparse.Namespace) -> tuple[Entrypoint, list[str]]:
    script, script_args = args.training_script, list(args.training_script_args)
    if args.run_path:
        return run_script_path, [script, *script_args]
    if args.no_python:
        if shutil.which(script) is None:
            raise ConfigurationError(f"training script {script!r}: no such executable (--no-python runs it as one)")
        return script, script_args
    if not args.module and not os.path.isfile(script):
        raise ConfigurationError(f"training script {script!r}: no such file")
    return environ.python_executable(), ["-u", *(["-m"] if args.module else []), script, *script_args]


def _load_plugins(args: argparse.Namespace, config: LaunchConfig) -> LaunchConfig:
    """The plugins the flags name, loaded (or refused) now: a --logs-specs class, the event handler, and the
    metrics endpoint's dependency."""
    if args.logs_specs not in (None, "default"):  # torch's entry-point group; importing the class imports torch
        from .logs_specs import load_logs_specs

        specs = load_logs_specs(
            args.logs_specs,
            log_dir=config.logs.dir,
            redirects=config.logs.redirects,
            tee=config.logs.tee,
            local_ranks_filter=config.logs.local_ranks_filter,
        )
        config = dataclasses.replace(config, logs_specs=specs)
    check_event_handler(config.event_log_handler)
    if config.metrics_port is not None:
        check_metrics_available()
    return config


def _explain_ignored(args: argparse.Namespace, backend: str) -> None:
    """torchrun flags accepted here that do nothing, or nothing with these others: say so once, never fail."""
    if args.standalone and (args.rdzv_endpoint or args.rdzv_backend != "static"):
        logger.warning("--standalone: ignoring --rdzv-backend/--rdzv-endpoint; using c10d on localhost:0")
    if backend != "static" and (args.node_rank != 0 or args.master_addr != "127.0.0.1"):
        logger.warning("--node-rank/--master-addr only apply to --rdzv-backend static; ignored")
    ignored = {
        "--numa-binding": (args.numa_binding, "torchrun would start each worker under 'numactl --physcpubind' "
                           "with the CPUs of its GPU's NUMA node (or socket, core complex); aelastic binds nothing "
                           "(no GPU to bind by on a CPU-only build)"),
        "--start-method": (args.start_method != "spawn" and args.start_method, "workers always start as fresh "
                           "processes"),
    }  # fmt: skip
    for flag, (value, why) in ignored.items():
        if value:
            logger.warning("%s %s: accepted for torchrun compatibility and ignored: %s", flag, value, why)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RunCommand:
    """Map torchrun's arguments onto a LaunchConfig and a worker command, refusing bad input; see the module doc.

    Raises:
        ConfigurationError: a value breaks a rule; the message names the flag and the value.
    """
    return resolve(args, env).command


def resolve(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Resolved:
    """:func:`config_from_args` with each value's source, after the Slurm source (:mod:`.slurm`) filled in what no
    flag or ``PET_*`` variable gave; logs nothing (the caller logs ``slurm_line``).

    Raises:
        ConfigurationError: a value breaks a rule; the message names the flag (or the variable) and the value.
    """
    env = os.environ if env is None else env
    args, derived, slurm_line = apply_slurm(args, env)
    nproc = parse_nproc(str(args.nproc_per_node), env)
    check_at_least(args.max_restarts, 0, f"--max-restarts {args.max_restarts}")  # LaunchConfig's rule, named
    check_at_least(args.max_repeated_failures, 0, f"--max-repeated-failures {args.max_repeated_failures}")
    if args.checkpoint_dir is not None:
        check_writable_dir(args.checkpoint_dir, "--checkpoint-dir")  # LaunchConfig's rule, named
    parse_signals(args.signals_to_handle)  # as the user wrote it (LaunchConfig's errors name its fields)
    forwarded = resolve_forwarded(args.signals_to_forward, args.signals_to_handle)
    if args.module and args.no_python:
        raise ConfigurationError("-m/--module and --no-python cannot be used together: -m runs python")
    rdzv = _rendezvous(args)
    if args.node_check:
        check_node_check(rdzv.backend, f"--node-check with --rdzv-backend {rdzv.backend}")  # LaunchConfig's, named
    template = args.log_line_prefix_template  # '' is a template too: no prefix
    if template is None:
        template = environ.log_line_prefix_template()
    fields = {f.field: f.convert(getattr(args, f.dest)) if f.convert else getattr(args, f.dest) for f in
              flags() if f.field is not None}  # fmt: skip
    config = LaunchConfig.from_fields({
        **fields,
        "min_nodes": rdzv.min_nodes,
        "max_nodes": rdzv.max_nodes,
        "nproc_per_node": nproc,
        "run_id": rdzv.run_id,
        "rdzv_endpoint": rdzv.endpoint,
        "rdzv_backend": rdzv.backend,
        "rdzv_configs": rdzv.configs,
        "log_line_prefix_template": template,
        "signals_to_forward": ",".join(s.name for s in forwarded),  # resolved: --dry-run shows what is forwarded
    })  # fmt: skip
    config = _load_plugins(args, config)
    check_parameters(config.rendezvous_parameters(config.run_id))
    entrypoint, script_args = _entrypoint(args)
    _explain_ignored(args, config.rdzv_backend or "c10d")
    return Resolved(RunCommand(config, entrypoint, script_args), sources(config, args, env, derived), slurm_line)
