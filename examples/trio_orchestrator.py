"""A trio application that awaits two elastic jobs at once while it serves their progress.

The same learning-rate sweep as ``asyncio_orchestrator.py``, written the trio way: the jobs are two
``await aelastic.launch`` calls in a nursery, next to the progress endpoint the workers stream to; a time budget
is a cancel scope's deadline, and Ctrl-C is a signal receiver that cancels that scope. A cancelled launch stops and
reaps its workers before it returns, so the application can check that no worker process is left.

    python examples/trio_orchestrator.py                     # both jobs train, then the results
    python examples/trio_orchestrator.py --steps 100000 --cancel-after 5
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from functools import partial

import cloudpickle
import sweep
import trio

import aelastic

cloudpickle.register_pickle_by_value(sweep)  # the workers get sweep.train by value: they need not import sweep


async def serve_progress(progress: sweep.Progress, stream: trio.SocketStream) -> None:
    pending = b""
    async with stream:
        async for chunk in stream:
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                progress.handle(line)


async def cancel_on_ctrl_c(
    scope: trio.CancelScope, interrupted: trio.Event, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        task_status.started()
        async for _ in signals:
            interrupted.set()
            scope.cancel()
            return


async def run_job(results: dict[float, dict[int, float]], lr: float, args: argparse.Namespace, port: int) -> None:
    config = aelastic.LaunchConfig(nproc_per_node=sweep.NPROC, max_restarts=0)
    results[lr] = await aelastic.launch(config, sweep.train, lr, args.steps, args.step_time, port)


async def main(args: argparse.Namespace) -> int:
    progress, interrupted = sweep.Progress(), trio.Event()
    results: dict[float, dict[int, float]] = {}
    async with trio.open_nursery() as services:
        serve = partial(trio.serve_tcp, partial(serve_progress, progress), 0, host="127.0.0.1")
        listeners = await services.start(serve)
        port = listeners[0].socket.getsockname()[1]
        print(f"progress endpoint on 127.0.0.1:{port}", flush=True)
        with trio.move_on_after(math.inf if args.cancel_after is None else args.cancel_after) as sweep_scope:
            await services.start(cancel_on_ctrl_c, sweep_scope, interrupted)
            async with trio.open_nursery() as jobs:
                for lr in sweep.LEARNING_RATES:
                    jobs.start_soon(run_job, results, lr, args, port)
        services.cancel_scope.cancel()  # the sweep is over: stop serving and watching for Ctrl-C
    if interrupted.is_set():
        progress.print_cancelled("interrupted")
        return 130
    if sweep_scope.cancelled_caught:
        progress.print_cancelled(f"time budget of {args.cancel_after} s spent")
        return 0
    sweep.print_results(results)
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sweep.parse_args(__doc__.split("\n", 1)[0])))
