"""The job's restart budget (``--max-restarts-scope job``) and the stop for lack of progress
(``--max-repeated-failures``), end to end: real agents on loopback, c10d through a shared store (issue 31)."""

from __future__ import annotations

import pytest
import test_agent_e2e
from test_agent_e2e import Job, c10d, common

pytestmark = [pytest.mark.anyio, pytest.mark.torch]

job = test_agent_e2e.job
rendezvous_store = test_agent_e2e.rendezvous_store

# Each node's worker fails once: node "a" in the first attempt, node "b" at the start of the next one (once "a"'s
# marker exists when it starts); every other worker runs 5 s and succeeds.
FAILS_ONCE_PER_NODE = """
node = os.environ["NODE"]
report("started", node=node)
marker = os.path.join(OUT, "failed-" + node)
if not os.path.exists(marker) and (node == "a" or os.path.exists(os.path.join(OUT, "failed-a"))):
    time.sleep(1 if node == "a" else 0)
    open(marker, "w").close()
    sys.exit(3)
time.sleep(5)
"""


@pytest.mark.parametrize(("scope", "code", "failures"), [("job", 1, 2), ("node", 0, 2)])
async def test_two_nodes_failing_once_each_spend_a_job_budget_of_one(
    job: Job, rendezvous_store: str, scope: str, code: int, failures: int
) -> None:
    script = job.script("fails_once_per_node.py", FAILS_ONCE_PER_NODE)
    args = [*c10d(rendezvous_store, "2", "is_host=false"), *common(1, "--max-restarts", "1"),
            "--max-restarts-scope", scope, script, job.out]  # fmt: skip
    agents = [await job.agent(*args, env={"NODE": node}) for node in ("a", "b")]
    codes = [await agent.wait() for agent in agents]
    assert codes == [code, code], [a.output for a in agents]
    assert len(list(job.out.glob("failed-*"))) == failures
    if scope == "job":  # node b's own budget was untouched, but the job's was spent by node a
        b = agents[1].output
        assert "Root Cause (first observed failure)" in b
        assert "exitcode  : 3" in b


FAILS_AT_STEP_5 = """
import aelastic.checkpoint as ckpt
state = ckpt.load() or {"step": -1}
report("started", step=state["step"])
for step in range(state["step"] + 1, 100):
    if step == 5:
        raise RuntimeError("the batch at step 5 is corrupt")
    state["step"] = step
    ckpt.save(state, step=step)
"""


async def test_a_job_failing_at_the_same_step_three_times_stops_with_status_3(job: Job) -> None:
    script = job.script("fails_at_step_5.py", FAILS_AT_STEP_5)
    agent = await job.agent("--standalone", *common(1, "--max-restarts", "10", "--max-repeated-failures", "3"),
                            script, job.out)  # fmt: skip
    assert await agent.wait() == 3, agent.output
    assert [r["step"] for r in sorted(job.records("started"), key=lambda r: r["time"])] == [-1, 4, 4]
    output = agent.output
    assert (
        "no progress: the last 3 attempts failed the same way (rank 0: RuntimeError: the batch at step 5 is corrupt, "
        "at step 4); stopped with restarts left (--max-repeated-failures 3): requeueing the job would fail again"
    ) in output, output
    assert "restart 2 of 10" in output
    assert "restart 3 of 10" not in output
