"""The node check's pure core (``aelastic.agent.nodecheck.plan``): the groups of each check round, the verdict, and
the messages, without an agent, a store or torch. The check across agents is tests/test_node_check.py's, and across
hosts (a throttled link) tests/faults/test_node_check.py's."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aelastic.agent.nodecheck.plan import (
    Figures,
    Hello,
    Round,
    decode_figures,
    decode_hello,
    describe,
    encode_figures,
    encode_hello,
    first_groups,
    judge,
    second_groups,
)
from aelastic.errors import RendezvousStateError

FAST, SLOW = 0.010, 0.400  # seconds per all-reduce through a healthy link, and through a throttled one
MATMUL = 0.004


def ok(comm: float | None = FAST, compute: float = MATMUL) -> Figures:
    return Figures(compute=compute, comm=comm, device="cpu", size=4 << 20)


def broken_link(error: str = "RuntimeError: Connection closed by peer") -> Figures:
    return Figures(compute=MATMUL, comm_error=error, device="cpu", size=4 << 20)


def two_rounds(first: dict[int, Figures], second: dict[int, Figures]) -> list[Round]:
    """Round 1 in rank order; round 2 as second_groups makes it from round 1's figures."""
    r1 = Round(first_groups(first), first)
    return [r1, Round(second_groups(r1), second)]


# --- groups ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "groups"),
    [
        ([], ()),
        ([0], ((0,),)),
        ([1, 0], ((0, 1),)),
        ([0, 1, 2], ((0, 1, 2),)),
        ([3, 2, 1, 0], ((0, 1), (2, 3))),
        ([0, 1, 2, 3, 4], ((0, 1), (2, 3, 4))),
        ([0, 2, 5], ((0, 2, 5),)),  # ranks whose process cannot take part are simply absent
    ],
)
def test_round_one_groups_the_ranks_in_order_two_by_two_the_odd_one_joining_the_last(
    ranks: list[int], groups: tuple[tuple[int, ...], ...]
) -> None:
    assert first_groups(ranks) == groups


def test_round_two_pairs_the_fastest_with_the_slowest_and_failures_count_as_slowest() -> None:
    figures = {0: ok(0.020), 1: ok(0.010), 2: broken_link(), 3: ok(SLOW), 4: ok(0.015), 5: ok(0.030)}
    # fastest first: 1, 4, 0, 5, 3, then the failure 2
    assert second_groups(Round((), figures)) == ((1, 2), (3, 4), (0, 5))


def test_round_two_leaves_out_a_member_whose_compute_failed_and_the_middle_one_joins_the_last_pair() -> None:
    figures = {0: ok(0.010), 1: Figures.failed("the check process exited with 1"), 2: ok(0.030), 3: ok(0.020)}
    assert second_groups(Round((), figures)) == ((0, 2, 3),)  # 0 with 2, and 3 (the middle) joins them


@given(st.dictionaries(st.integers(0, 63), st.one_of(st.none(), st.floats(0, 10)), max_size=40))
def test_every_able_member_is_in_exactly_one_group_of_each_round(comms: dict[int, float | None]) -> None:
    figures = {rank: broken_link() if comm is None else ok(comm) for rank, comm in comms.items()}
    for groups in (first_groups(figures), second_groups(Round((), figures))):
        members = [rank for group in groups for rank in group]
        assert sorted(members) == sorted(figures)
        assert all(list(group) == sorted(group) for group in groups)
        assert all(2 <= len(group) <= 3 for group in groups) or len(figures) < 2


# --- the verdict ----------------------------------------------------------------------------------------------------


def test_a_slow_link_is_left_out_and_its_round_one_peer_is_cleared_by_round_two() -> None:
    # Round 1: (0, 1) fast, (2, 3) slow. Round 2: (0, 3) and (1, 2): 3 is slow again, 2 is fast with 1.
    rounds = two_rounds({0: ok(), 1: ok(), 2: ok(SLOW), 3: ok(SLOW)}, {0: ok(SLOW), 1: ok(), 2: ok(), 3: ok(SLOW)})
    assert rounds[1].groups == ((0, 3), (1, 2))
    verdict = judge(rounds, new={0, 1, 2, 3}, slowdown=2.0)
    assert list(verdict.left_out) == [3]
    assert verdict.left_out[3] == "all-reduce 400 ms, 40.0x the median 10 ms (bound: --node-check-slowdown 2)"
    assert verdict.comm == {0: FAST, 1: FAST, 2: FAST, 3: SLOW}
    assert verdict.kept == {}


def test_a_slow_device_is_left_out_by_its_matmul() -> None:
    slow = {0: ok(), 1: ok(), 2: ok(compute=3 * MATMUL)}
    verdict = judge(two_rounds(slow, slow), new={0, 1, 2}, slowdown=2.0)
    assert verdict.left_out == {2: "matmul 12 ms, 3.0x the median 4 ms (bound: --node-check-slowdown 2)"}


def test_the_better_of_two_rounds_counts() -> None:
    # rank 2's first matmul was slow (a moment of contention), its second was not
    rounds = two_rounds({0: ok(), 1: ok(), 2: ok(compute=5 * MATMUL)}, {0: ok(), 1: ok(), 2: ok()})
    assert judge(rounds, new={0, 1, 2}, slowdown=2.0).left_out == {}


def test_a_failed_check_leaves_the_node_out_and_clears_its_peers() -> None:
    failed = Figures.failed("the check process exited with 1")  # after round 1's command: its peer 2 waited
    r1 = Round(((0, 1), (2, 3)), {0: ok(), 1: ok(), 2: broken_link("peer 3 never came"), 3: failed})
    r2 = Round(second_groups(r1), {0: ok(), 1: ok(), 2: ok(), 3: failed})
    assert 3 not in {rank for group in r2.groups for rank in group}
    verdict = judge([r1, r2], new={0, 1, 2, 3}, slowdown=2.0)
    assert verdict.left_out == {3: "its check failed: the check process exited with 1"}


def test_a_broken_link_fails_both_rounds_and_its_peers_only_one() -> None:
    rounds = two_rounds(
        {0: ok(), 1: ok(), 2: broken_link(), 3: broken_link()},
        {0: broken_link(), 1: ok(), 2: ok(), 3: broken_link("RuntimeError: timed out")},
    )
    assert rounds[1].groups == ((0, 3), (1, 2))
    verdict = judge(rounds, new={0, 1, 2, 3}, slowdown=2.0)
    assert verdict.left_out == {
        3: "its all-reduce failed in every round: with rank 2 in round 1: RuntimeError: Connection closed by peer; "
        "with rank 0 in round 2: RuntimeError: timed out"
    }


def test_a_failure_beside_a_peer_that_failed_on_its_own_is_the_peers() -> None:
    why = "the check process did not answer within 30 s"
    r1 = Round(((0, 1),), {0: broken_link(), 1: Figures.failed(why)})
    r2 = Round(((0,),), {0: ok(comm=None), 1: Figures.failed(why)})
    assert judge([r1, r2], new={0, 1}, slowdown=2.0).left_out == {1: f"its check failed: {why}"}


def test_with_two_nodes_a_broken_link_cannot_be_blamed_on_either_and_both_are_left_out() -> None:
    rounds = two_rounds({0: broken_link(), 1: broken_link()}, {0: broken_link(), 1: broken_link()})
    assert rounds[1].groups == ((0, 1),)
    assert sorted(judge(rounds, new={0, 1}, slowdown=2.0).left_out) == [0, 1]


def test_slowness_needs_three_figures() -> None:
    # Of two, the median is their mean, which neither exceeds twice: nothing to judge by.
    rounds = two_rounds({0: ok(), 1: ok(SLOW, compute=10 * MATMUL)}, {0: ok(), 1: ok(SLOW, compute=10 * MATMUL)})
    assert judge(rounds, new={0, 1}, slowdown=1.01).left_out == {}


def test_only_new_members_are_judged_and_a_kept_one_is_only_reported() -> None:
    slow = {0: ok(SLOW), 1: ok(), 2: ok(), 3: ok(SLOW), 4: ok()}  # 0 and 3 slow in both rounds
    rounds = [Round(((0, 3), (1, 2, 4)), slow), Round(((0, 3), (1, 2, 4)), slow)]
    assert list(judge(rounds, new={1, 2, 3}, slowdown=2.0).left_out) == [3]  # 0 is trusted
    verdict = judge(rounds, new={0, 3}, slowdown=2.0, kept={0})
    assert list(verdict.left_out) == [3]
    assert list(verdict.kept) == [0]
    assert verdict.kept[0].startswith("all-reduce 400 ms")


def test_an_infinite_bound_leaves_no_slow_node_out_but_still_a_failed_one() -> None:
    figures = {0: ok(), 1: ok(), 2: ok(SLOW, compute=100 * MATMUL), 3: Figures.failed("no CUDA device")}
    rounds = [Round(((0, 1), (2,)), figures), Round(((0, 1), (2,)), figures)]
    assert judge(rounds, new={0, 1, 2, 3}, slowdown=math.inf).left_out == {3: "its check failed: no CUDA device"}


def test_describe_gives_every_members_figures() -> None:
    rounds = two_rounds({0: ok(), 1: ok(), 2: broken_link()}, {0: ok(), 1: ok(), 2: broken_link()})
    text = describe(judge(rounds, new={0, 1, 2}, slowdown=2.0), rounds)
    assert text == (
        "rank 0 (cpu): matmul 4 ms, all-reduce of 4 MiB 10 ms; rank 1 (cpu): matmul 4 ms, all-reduce of 4 MiB 10 ms; "
        "rank 2 (cpu): matmul 4 ms, all-reduce failed"
    )


# --- messages -------------------------------------------------------------------------------------------------------


def test_messages_round_trip() -> None:
    hello = Hello(new=True, store="[::1]:4242", error=None, serves_rendezvous=True)
    assert decode_hello(encode_hello(hello), 0) == hello
    for figures in (ok(), broken_link(), Figures.failed("gone"), Figures(compute=0, comm=None)):
        assert decode_figures(encode_figures(figures), 1) == figures


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not json", "not a JSON object"),
        (b"[1]", "not a JSON object"),
        (b'{"v": 2, "new": true}', "of version 2, this agent reads 1"),
        (b'{"v": 1, "new": true}', "lacks 'store'"),
        (b'{"v": 1, "new": 1, "store": "h:1", "error": null, "serves_rendezvous": false}', "malformed"),
    ],
)
def test_a_hello_that_is_not_ours_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(RendezvousStateError, match=message):
        decode_hello(data, 3)


def test_figures_that_are_not_ours_are_refused() -> None:
    good = encode_figures(ok())
    with pytest.raises(RendezvousStateError, match="rank 2's figures are malformed"):
        decode_figures(good.replace(b'"compute": 0.004', b'"compute": -1'), 2)
    with pytest.raises(RendezvousStateError, match="figures lacks 'device'"):
        decode_figures(b'{"v": 1, "compute": 1, "comm": 1, "compute_error": null, "comm_error": null}', 2)


def test_the_core_imports_no_event_loop_no_socket_and_no_torch() -> None:
    code = (
        "import sys, aelastic.agent.nodecheck.plan\n"
        "print(sorted(m for m in ('anyio', 'asyncio', 'trio', 'socket', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout
