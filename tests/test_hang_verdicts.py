"""Hang detection's verdicts on real workers, the fast part of ``benchmarks/hang_verdicts.py``: each true hang of
``tests/hang_cases.py`` is found and its rank named; each false one, which lasts 2.5 times ``--hang-timeout``,
ends well with no verdict. One node, two gloo ranks, ``--hang-timeout 3``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import test_agent_e2e
from test_agent_e2e import Job, common

pytestmark = [pytest.mark.anyio, pytest.mark.torch]

job = test_agent_e2e.job

CASES = Path(__file__).with_name("hang_cases.py")
TIMEOUT = 3.0
NAMED = {"sleep": "rank 1 named", "stop": "rank 1 named", "io": "rank 1 named", "deadlock": "ranks 0-1 named"}


async def run_case(job: Job, case: str) -> tuple[int, str]:
    agent = await job.agent("--standalone", *common(2, "--hang-timeout", str(TIMEOUT), "--max-restarts", "0"),
                            CASES, case, str(2.5 * TIMEOUT), job.out)  # fmt: skip
    return await agent.wait(test_agent_e2e.DEADLINE), agent.output


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("case", sorted(NAMED))
async def test_a_true_hang_is_found_and_its_rank_named(job: Job, case: str) -> None:
    code, output = await run_case(job, case)
    assert code != 0, output
    verdict = re.search(r"hang: no rank of the job made progress .*; (.* named) \((.*)\):", output)
    assert verdict is not None, output
    assert verdict[1] == NAMED[case], output


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("case", ["checkpoint", "device", "evaluation", "loader"])
async def test_a_rank_busy_where_nothing_shows_it_hung_is_not_called_hung(job: Job, case: str) -> None:
    code, output = await run_case(job, case)
    assert "hang:" not in output, output
    assert code == 0, output
