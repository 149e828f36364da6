"""The job's root cause (:mod:`aelastic.agent.rootcause`): what each failure is, which one is the cause, and two
nodes agreeing through a real store (the end-to-end test on two hosts is ``tests/faults/test_root_cause.py``)."""

from __future__ import annotations

import json

import anyio
import pytest

from aelastic.agent.errors import ProcessFailure
from aelastic.agent.rootcause import (
    CAUSE_KEY,
    FailureRecord,
    JobFailures,
    as_reported,
    first_cause,
    kind_of,
    with_cause,
)
from aelastic.store.client import open_store_client
from aelastic.store.server import open_store_server

pytestmark = pytest.mark.anyio

GLOO = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:1234"


def failure(rank: int, message: str, *, exitcode: int = 1, traceback: str = "") -> ProcessFailure:
    return ProcessFailure(rank % 2, rank, 100 + rank, exitcode, "<N/A>", 0.0, message, traceback or message, {})


def test_a_failure_is_a_victim_a_stopped_peer_or_its_own() -> None:
    assert kind_of(failure(0, "ValueError: bad shard"), stopped=False) == "failed"
    assert kind_of(failure(0, GLOO), stopped=False) == "victim"
    assert kind_of(failure(0, GLOO, exitcode=-15), stopped=True) == "victim"  # its collective failed first
    assert kind_of(failure(0, "Signal 15 (SIGTERM) received by PID 100", exitcode=-15), stopped=True) == "stopped"
    # No error file: the exception's line is the last line of the stderr tail, not a frame's path.
    tail = 'Traceback (most recent call last):\n  File "/x/torch/distributed/c10d_logger.py", line 1\nKeyError: 3'
    assert kind_of(failure(0, "exited with code 1", traceback=tail), stopped=False) == "failed"


def test_the_first_own_failure_in_the_stores_order_is_the_cause() -> None:
    victim = FailureRecord(1, 0, "a", "victim", failure(0, GLOO))
    cause = FailureRecord(2, 1, "b", "failed", failure(2, "RuntimeError: x"))
    later = FailureRecord(3, 0, "a", "failed", failure(1, "RuntimeError: y"))
    assert first_cause([later, victim, cause]) == cause
    assert first_cause([victim]) == victim  # only victims: the first one
    assert first_cause([]) is None
    assert with_cause(cause.failure, "failed", cause) == cause.failure  # the cause itself is not marked
    marked = with_cause(victim.failure, "victim", cause).traceback.splitlines()[-1]
    assert marked == "  aelastic: a victim: its collective failed after the job's root cause, rank 2 on node 1"
    assert as_reported(cause).host == "b (node 1)"


def test_a_record_crosses_the_store_as_json_and_a_huge_error_file_stays_behind() -> None:
    record = FailureRecord(7, 1, "h", "failed", failure(2, "RuntimeError: x"))
    assert FailureRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    huge = FailureRecord(8, 1, "h", "failed", ProcessFailure(0, 2, 3, 1, "/e", 0.0, "m", "t", {"x": "y" * (1 << 17)}))
    assert FailureRecord.from_json(huge.to_json()).failure.error_data == {}


async def test_two_nodes_name_the_same_cause_though_a_victim_was_published_first() -> None:
    async with (
        open_store_server("127.0.0.1", 0) as server,
        open_store_client("127.0.0.1", server.port) as first,
        open_store_client("127.0.0.1", server.port) as second,
    ):
        fast, slow = JobFailures(first, 0, 2), JobFailures(second, 1, 2)
        await fast.publish([(failure(0, GLOO), "victim")])  # node 0's victim reaches the store first
        async with anyio.create_task_group() as tg:
            seen: dict[str, list[FailureRecord]] = {}

            async def collect(name: str, job: JobFailures) -> None:
                seen[name] = await job.collect(30)

            tg.start_soon(collect, "fast", fast)  # waits: its only record is a victim
            await anyio.sleep(0.2)
            await slow.publish([(failure(2, "RuntimeError: rank 2"), "failed")])
            tg.start_soon(collect, "slow", slow)
        assert first_cause(seen["fast"]) == first_cause(seen["slow"])
        cause = first_cause(seen["fast"])
        assert cause is not None
        assert (cause.seq, cause.node, cause.failure.global_rank) == (2, 1, 2)
        kept = FailureRecord.from_json(json.loads(await first.get(CAUSE_KEY)))
        assert kept == cause


async def test_a_node_that_never_reports_costs_the_wait_and_no_more() -> None:
    async with open_store_server("127.0.0.1", 0) as server, open_store_client("127.0.0.1", server.port) as client:
        job = JobFailures(client, 0, 2)
        await job.publish([(failure(1, GLOO), "victim")])
        with anyio.fail_after(10):
            started = anyio.current_time()
            records = await job.collect(0.5)  # node 1 is gone: its done key never comes
        assert 0.5 <= anyio.current_time() - started < 5
        assert [r.kind for r in records] == ["victim"]
