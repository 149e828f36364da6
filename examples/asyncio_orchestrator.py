"""An asyncio application that awaits two elastic jobs at once while it serves their progress (Python 3.11+).

A learning-rate sweep: one job of two gloo workers per learning rate, both launched with ``await aelastic.launch``
in one ``asyncio.TaskGroup``, while the same event loop serves the endpoint the workers stream their progress to.
Cancelling (Ctrl-C, or the ``--cancel-after`` time budget) cancels both launches; each stops and reaps its workers
before the cancellation completes, so the application can check that no worker process is left.

    python examples/asyncio_orchestrator.py                     # both jobs train, then the results
    python examples/asyncio_orchestrator.py --steps 100000 --cancel-after 5
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from functools import partial

if sys.version_info < (3, 11):  # aelastic itself runs on 3.10; asyncio's structured concurrency came in 3.11
    sys.exit("examples/asyncio_orchestrator.py needs Python 3.11 (asyncio.TaskGroup, asyncio.timeout); "
             "examples/trio_orchestrator.py does the same on trio")  # fmt: skip

import cloudpickle
import sweep

import aelastic

cloudpickle.register_pickle_by_value(sweep)  # the workers get sweep.train by value: they need not import sweep


async def serve_progress(progress: sweep.Progress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while line := await reader.readline():
            progress.handle(line)
    finally:
        writer.close()


async def run_sweep(args: argparse.Namespace, port: int) -> dict[float, dict[int, float]]:
    config = aelastic.LaunchConfig(nproc_per_node=sweep.NPROC, max_restarts=0)
    async with asyncio.TaskGroup() as tg:
        jobs = {
            lr: tg.create_task(aelastic.launch(config, sweep.train, lr, args.steps, args.step_time, port))
            for lr in sweep.LEARNING_RATES
        }
    return {lr: job.result() for lr, job in jobs.items()}


async def main(args: argparse.Namespace) -> None:
    progress = sweep.Progress()
    server = await asyncio.start_server(partial(serve_progress, progress), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    print(f"progress endpoint on 127.0.0.1:{port}", flush=True)
    async with server:
        try:
            async with asyncio.timeout(args.cancel_after):
                results = await run_sweep(args, port)
        except TimeoutError:
            progress.print_cancelled(f"time budget of {args.cancel_after} s spent")
            return
        except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels this task, then raises KeyboardInterrupt
            progress.print_cancelled("interrupted")
            raise
    sweep.print_results(results)


if __name__ == "__main__":
    try:
        asyncio.run(main(sweep.parse_args(__doc__.split("\n", 1)[0])))
    except KeyboardInterrupt:
        sys.exit(130)
