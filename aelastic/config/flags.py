"""``aelastic run``'s flags as data: torchrun's, in torchrun's order and groups, then aelastic's own. Each says how
it is spelled, its default, how its text becomes a value, and the :class:`~aelastic.config.LaunchConfig` field it
sets (dotted for a field of an options record: ``checkpoint.memory``). ``aelastic.cli`` builds the parser from this
table; :mod:`.command` sets each field from it, and :mod:`.sources` names each value's flag.

A flag's default is ``PET_<DEST>`` when that is set (torch's ``env`` action; ``PET_<DEST>=1`` turns a switch on),
except for those marked ``pet=False``, for which torchrun reads no variable either.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .values import (
    DEFAULT_FORWARDED,
    DEFAULT_NODE_CHECK_SLOWDOWN,
    DEFAULT_SIGNALS,
    UNKILLABLE_TIMEOUT,
    comma_list,
    parse_port,
    parse_positive,
    parse_ranks_filter,
    parse_seconds,
    parse_size,
    parse_slowdown,
    parse_std,
)

__all__ = ["ASYNC_BACKENDS", "GROUPS", "Flag", "Group", "flags"]

ASYNC_BACKENDS = ("asyncio", "trio")


@dataclass(frozen=True, slots=True)
class Flag:
    """One option of ``aelastic run``."""

    names: tuple[str, ...]  # as torchrun spells them; each ``--a-b`` is accepted as ``--a_b`` too
    dest: str
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = None  # a converter of .values raises ConfigurationError: one line
    choices: Sequence[Any] | None = None
    switch: bool = False  # takes no value: given, it is on
    pet: bool = True  # PET_<DEST> gives its default
    field: str | None = None  # the LaunchConfig field it sets; None: .command reads it
    convert: Callable[[Any], Any] | None = None  # the parsed value into the field's


@dataclass(frozen=True, slots=True)
class Group:
    title: str
    flags: tuple[Flag, ...]


def _non_empty(values: Sequence[str]) -> tuple[str, ...]:
    """A comma list with its empty items dropped (torch: '' filters nothing)."""
    return tuple(v for v in values if v)


def _std(flag: str) -> Callable[[Any], Any]:
    def convert(text: Any) -> Any:
        return parse_std(flag, str(text))

    return convert


GROUPS: tuple[Group, ...] = (
    Group("Worker/node size", (
        Flag(("--nnodes",), "nnodes", default="1:1",
             help="number of nodes, or the range MIN:MAX for an elastic job (default: %(default)s)"),
        Flag(("--nproc-per-node",), "nproc_per_node", default="1",
             help="workers per node: an integer, cpu (one per CPU), gpu (one per visible NVIDIA GPU) or auto (gpu "
             "if there are GPUs, else cpu) (default: %(default)s)"),
    )),
    Group("Rendezvous", (
        Flag(("--rdzv-backend",), "rdzv_backend", default="static",
             help="c10d, etcd (etcd-v2 is an alias), static, or a registered plugin (default: %(default)s)"),
        Flag(("--rdzv-endpoint",), "rdzv_endpoint", default="",
             help="HOST[:PORT] of the rendezvous store (c10d) or of etcd (etcd: HOST:PORT,...); with "
             "--rdzv-backend etcd, embedded:HOST,HOST,... runs the job's own etcd on the first hosts, no node "
             "special; IPv6 as [ADDR]:PORT; an address given is never reverse-resolved (default: none; static uses "
             "--master-addr:--master-port)"),
        Flag(("--rdzv-id",), "rdzv_id", default="none", help="the job's run id (default: %(default)s)"),
        Flag(("--rdzv-conf",), "rdzv_conf", default="",
             help="KEY=VALUE,... e.g. join_timeout=600,last_call_timeout=30,close_timeout=30,is_host=true "
             "(default: none)"),
        Flag(("--standalone",), "standalone", switch=True,
             help="one node: c10d on localhost with a free port and a random run id; --rdzv-backend, "
             "--rdzv-endpoint and --rdzv-id are ignored. Automatic for one static node with no endpoint and no "
             "--master-port, as in torch 2.14 (default: off)"),
    )),
    Group("User-code launch", (
        Flag(("--max-restarts",), "max_restarts", default=0, type=int, field="max_restarts",
             help="failure restarts before the job fails; membership changes do not count (default: %(default)s)"),
        Flag(("--monitor-interval",), "monitor_interval", default=0.1, type=float, field="monitor_interval",
             help="accepted for torchrun compatibility, no effect: aelastic awaits worker exits, it does not poll "
             "(default: %(default)s)"),
        Flag(("--start-method",), "start_method", default="spawn", choices=("spawn", "fork", "forkserver"),
             field="start_method",
             help="accepted for torchrun compatibility; workers always start as fresh processes (default: "
             "%(default)s)"),
        Flag(("--event-log-handler",), "event_log_handler", default="null", field="event_log_handler",
             help="where torch's events (and aelastic's rendezvous events) go: null, console (JSON lines on "
             "stderr), file (events.jsonl in this run's log directory, <--log-dir>/<run id>_<random suffix>/, "
             "beside attempt_<n>/) or a handler registered under the aelastic.event_handlers entry points "
             "(default: %(default)s)"),
        Flag(("--role",), "role", default="default", field="role", help="the workers' role (default: %(default)s)"),
        Flag(("-m", "--module"), "module", switch=True,
             help="run the script as a module, as 'python -m' does (default: off)"),
        Flag(("--no-python",), "no_python", switch=True,
             help="run the script as an executable, without python in front (default: off)"),
        Flag(("--run-path",), "run_path", switch=True,
             help="run the script with runpy.run_path in each worker; wins over --no-python (default: off)"),
        Flag(("--log-dir",), "log_dir", field="logs.dir",
             help="base directory for <run_id>_*/attempt_<n>/<local_rank>/{stdout,stderr}.log and error.json "
             "(default: a new temporary directory)"),
        Flag(("-r", "--redirects"), "redirects", default="0", field="logs.redirects", convert=_std("--redirects"),
             help="streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or LOCAL_RANK:N,... "
             "(default: %(default)s)"),
        Flag(("-t", "--tee"), "tee", default="0", field="logs.tee", convert=_std("--tee"),
             help="streams to log files and the console, as --redirects (default: %(default)s)"),
        Flag(("--local-ranks-filter",), "local_ranks_filter", default="", field="logs.local_ranks_filter",
             convert=parse_ranks_filter, help="comma list of local ranks whose output the console shows (default: "
             "all)"),
        Flag(("--log-line-prefix-template",), "log_line_prefix_template",
             help="console line prefix with ${role_name} ${rank} ${local_rank} ${hostname} (torch 2.14; '' for "
             "none, as torchrun without --tee; default: $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else "
             "[<role><local_rank>]:)"),
        *(Flag((f"--duplicate-{stream}-filters",), f"duplicate_{stream}_filters", default=[], type=comma_list,
               field=f"duplicate_{stream}_filters", convert=_non_empty,
               help=f"{stream} lines (of any worker) containing one of these strings are also written to <log "
               f"dir>/attempt_<n>/filtered_{stream}.log (default: none)")
          for stream in ("stdout", "stderr")),
    )),
    Group("Backwards compatible parameters with caffe2.distributed.launch", (
        Flag(("--node-rank",), "node_rank", default=0, type=int,
             help="this node's rank; static rendezvous only (default: %(default)s)"),
        Flag(("--master-addr",), "master_addr", default="127.0.0.1",
             help="address of the rank-0 node, static rendezvous only; IPv6 as [ADDR] (default: %(default)s)"),
        Flag(("--master-port",), "master_port", type=int,
             help="port of the rank-0 node's store, static rendezvous only (default: 29500)"),
        Flag(("--local-addr",), "local_addr", field="local_addr",
             help="this node's address for the rendezvous and the workers' store (default: the local address of "
             "the connection to the rendezvous store: routable by construction, never a reverse lookup)"),
        Flag(("--logs-specs",), "logs_specs", pet=False,
             help="a LogsSpecs class registered under the entry-point group 'torchrun.logs_specs' decides where "
             "workers' output and error files go, as with torchrun (imports torch); (default: default, torch's "
             "layout under --log-dir)"),
        Flag(("--numa-binding",), "numa_binding", pet=False, choices=("node", "socket", "exclusive", "core-complex"),
             help="accepted for torchrun compatibility; torchrun binds each worker to the CPUs of its GPU's NUMA "
             "node with numactl, aelastic binds nothing (default: none)"),
        Flag(("--signals-to-handle",), "signals_to_handle", default=DEFAULT_SIGNALS, field="signals_to_handle",
             help="signals that stop the workers and then the agent (default: %(default)s)"),
        Flag(("--shutdown-timeout",), "shutdown_timeout", type=float, field="shutdown_timeout",
             help="seconds between SIGTERM and SIGKILL when stopping workers (default: "
             "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)"),
        Flag(("--virtual-local-rank",), "virtual_local_rank", switch=True, field="virtual_local_rank",
             help="every worker sees LOCAL_RANK 0 and, where NVIDIA devices are visible, CUDA_VISIBLE_DEVICES set "
             "to its own device only (default: off)"),
    )),
    Group("aelastic (beyond torchrun; no torchrun flag changes meaning)", (
        Flag(("--async-backend",), "async_backend", pet=False, choices=ASYNC_BACKENDS, default=argparse.SUPPRESS,
             help="event loop to run on, as 'aelastic --async-backend' (default: asyncio; env "
             "AELASTIC_ASYNC_BACKEND)"),
        Flag(("--metrics-port",), "metrics_port", type=parse_port, field="metrics_port",
             help="serve this agent's Prometheus /metrics and /health on this port (0: a free one, logged); needs "
             "aelastic[metrics]. TORCHELASTIC_HEALTH_CHECK_PORT serves /health alone (default: off)"),
        Flag(("--watchdog-timeout",), "watchdog_timeout", type=parse_seconds, pet=False, field="timeouts.watchdog",
             help="kill (its stack dumped first) a worker whose aelastic.worker.heartbeat() calls stop for this "
             "many seconds; it then fails like any worker (default: off)"),
        Flag(("--max-restarts-scope",), "max_restarts_scope", default="node", choices=("node", "job"),
             field="restarts.scope",
             help="node: --max-restarts counts this node's failure restarts, as torchrun's; job: it counts the "
             "job's, once per restart whichever node failed (every node reads one count in the rendezvous store) "
             "(default: %(default)s)"),
        Flag(("--max-repeated-failures",), "max_repeated_failures", default=0, type=int,
             field="restarts.max_repeated_failures",
             help="stop the job, restarts left or not, when this many attempts in a row failed the same way (the "
             "same rank and error, at the same checkpointed step or as long after the start): it makes no "
             "progress; the report says so and aelastic run exits with status 3, which a requeue script can read "
             "as 'do not requeue'. 0: off (default: %(default)s)"),
        Flag(("--unkillable-timeout",), "unkillable_timeout", default=UNKILLABLE_TIMEOUT, type=parse_seconds,
             field="timeouts.unkillable",
             help="a worker still alive this many seconds after SIGKILL (uninterruptible sleep: a dead mount, a "
             "wedged device) is reported and the agent exits with status 4, so that the scheduler replaces the "
             "node (default: %(default)s)"),
        Flag(("--hang-timeout",), "hang_timeout", type=parse_seconds, field="timeouts.hang",
             help="a job hangs when none of its ranks has used CPU time for this many seconds (every node agrees, "
             "through the rendezvous store; no heartbeat in the script): every rank's stack is dumped, torch's "
             "Flight Recorder (turned on for the workers) asked for a dump, the odd ranks named (stopped, outside "
             "the collective the others wait in) and killed, and the attempt fails as any does (default: off)"),
        Flag(("--prewarm",), "prewarm", switch=True, field="prewarm.enabled",
             help="keep a standby interpreter per local rank that has imported torch, torch._dynamo (which any "
             "optimizer imports) and --prewarm-modules, and start Python workers in it: restarts skip the "
             "interpreter start and the imports; --no-python workers start as usual. With in-memory checkpoints, "
             "each standby also holds as much touched heap as the largest state in host memory a worker of the "
             "node saved, where its worker allocates its state (default: off)"),
        Flag(("--signals-to-forward",), "signals_to_forward",
             help="signals forwarded to every worker's process group while the workers and the agent run on (a "
             "scheduler's notice: Slurm's --signal); each worker sees each exactly once, also when the sender "
             "signalled the workers too. '' forwards none (default: " + DEFAULT_FORWARDED + " less any signal of "
             "--signals-to-handle)"),
        Flag(("--prewarm-modules",), "prewarm_modules", default=[], type=comma_list, field="prewarm.modules",
             convert=_non_empty, help="comma list of modules the standbys import besides torch (default: none)"),
        Flag(("--checkpoint-memory",), "checkpoint_memory", type=parse_size, field="checkpoint.memory",
             help="the shared memory one local rank's in-memory checkpoints (aelastic.checkpoint.save) may take: "
             "two copies of its state, three while the older is written to --checkpoint-dir or a replica if SIZE "
             "has room; a save of a state over half of it is refused; a replica of another node's ranks takes as "
             "much again; 0 turns the checkpoint service off (default: a quarter of this host's memory, shared "
             "among the local ranks)"),
        Flag(("--checkpoint-dir",), "checkpoint_dir", field="checkpoint.dir",
             help="write the latest complete in-memory checkpoint here (every --checkpoint-persist-every saves, "
             "after a worker failed, once the restart saved again, on a forwarded scheduler signal, and at the end), "
             "atomically and without blocking a step; aelastic.checkpoint.load() reads it when no agent's memory "
             "has one (a requeued job, a replaced node) (default: none)"),
        Flag(("--checkpoint-persist-every",), "checkpoint_persist_every", default=50, type=parse_positive,
             field="checkpoint.persist_every",
             help="write every N-th in-memory checkpoint to --checkpoint-dir (default: %(default)s)"),
        Flag(("--checkpoint-replicas",), "checkpoint_replicas", default=1, type=int, choices=(0, 1),
             field="checkpoint.replicas", convert=bool,
             help="1: each agent keeps a copy of the next node's in-memory checkpoints, sent in the background "
             "after each save, so that a lost node's ranks restore from memory (default: %(default)s)"),
        Flag(("--node-check",), "node_check", switch=True, field="node_check.enabled",
             help="test every node before the round that admits it: a matmul on its device and gloo all-reduces "
             "with peers, in two rounds (pairs, then the slowest with the fastest); a node that fails, or is "
             "--node-check-slowdown times slower than the median, is left out with the reason and the job goes "
             "on without it where --nnodes allows. Needs c10d or etcd; torch is imported in a check process, "
             "never in the agent; docs/howto/node-check.md (default: off)"),
        Flag(("--node-check-slowdown",), "node_check_slowdown", default=DEFAULT_NODE_CHECK_SLOWDOWN,
             type=parse_slowdown, field="node_check.slowdown",
             help="with --node-check: how many times slower than the median (matmul or all-reduce) a node may be "
             "before it is left out; a number > 1, inf for none (default: %(default)s)"),
        Flag(("--dry-run",), "dry_run", switch=True, pet=False,
             help="print the resolved configuration, each value with its source (flag, PET_* variable, Slurm "
             "variable, default), and exit; nothing is started (default: off)"),
    )),
)  # fmt: skip


def flags() -> tuple[Flag, ...]:
    """Every flag of the table, in order."""
    return tuple(flag for group in GROUPS for flag in group.flags)
