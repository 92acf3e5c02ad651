"""zb_uncapped, the ZB of the paper's own simulator (no activation cap), against the capped zb."""
from __future__ import annotations

import pytest

from impl.common.cost import LinkCosts, StageCosts
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import generate, zero_bubble_uncapped
from impl.common.schedule.validate import peak_inflight, validate_schedule
from impl.common.sim import CommModel, simulate_iteration

T = 0.01
SLOW_B = ([T] * 4, [2 * T] * 4, [T] * 4)  # tB = 2 tF: the first B reaches stage 0 late


@pytest.mark.parametrize("S,N", [(2, 2), (3, 4), (4, 12), (4, 3), (6, 18)])
@pytest.mark.parametrize("times", ["unit", "slow_b", "fast_b"])
def test_uncapped_schedule_is_valid(S, N, times):
    tf = [T] * S
    tb = {"unit": tf, "slow_b": [2 * T] * S, "fast_b": [T / 2] * S}[times]
    sched = zero_bubble_uncapped(S, N, tf, tb, tf)
    assert all(len(row) == 3 * N for row in sched.values())  # every F, B and W once per stage
    validate_schedule(sched, S, N, split_backward=True)
    validate_schedule(insert_comm(sched), S, N, split_backward=True)
    validate_schedule(insert_comm(sched, blocking_sends=True), S, N, split_backward=True, blocking_sends=True)


def test_uncapped_stores_more_than_2s_minus_1_when_b_is_slow():
    S, N = 4, 12
    capped = peak_inflight(generate("zb", S, N))
    uncapped = peak_inflight(zero_bubble_uncapped(S, N, *SLOW_B))
    assert capped[0] == 2 * S - 1
    # stage 0 keeps running forwards until B0 is back: S·tF + (S−1)·tB = 10 forward times
    assert uncapped[0] == 10 > 2 * S - 1
    assert all(uncapped[s] >= capped[s] for s in range(S))


@pytest.mark.parametrize("S,N", [(2, 3), (3, 5), (4, 7), (4, 12), (4, 24), (6, 18), (8, 32)])
def test_equals_capped_zb_with_uniform_ops_and_n_at_least_2s_minus_1(S, N):
    # The first B reaches stage i after exactly 2(S−i)−1 forward times, so the greedy warm-up
    # is the cap; afterwards both alternate B/F and defer W (the paper's ZB figures at uniform
    # op times therefore match the capped zb).
    assert generate("zb_uncapped", S, N) == generate("zb", S, N)
    assert zero_bubble_uncapped(S, N, [T] * S, [T] * S, [T] * S) == generate("zb", S, N)


@pytest.mark.parametrize("S,N", [(3, 3), (4, 4), (4, 6), (6, 7)])
def test_below_2s_minus_1_uncapped_holds_at_least_as_many(S, N):
    capped, uncapped = peak_inflight(generate("zb", S, N)), peak_inflight(generate("zb_uncapped", S, N))
    assert capped != uncapped
    assert all(capped[s] <= uncapped[s] <= N for s in range(S))


@pytest.mark.parametrize("link", [(0, 1), (1, 2), (2, 3)])
def test_uncapped_absorbs_at_least_as_much_delay_when_b_is_slow(link):
    S, N = 4, 12
    costs, links, comm = StageCosts(*map(tuple, SLOW_B)), LinkCosts.uniform(S), CommModel("latency")
    scheds = {"zb": insert_comm(generate("zb", S, N)),
              "uncapped": insert_comm(zero_bubble_uncapped(S, N, *SLOW_B))}

    def added(name, c):
        t = lambda d: simulate_iteration(scheds[name], costs, links, comm, delays=d).iteration_time_s  # noqa: E731
        return t({link: c}) - t({})

    gaps = [added("zb", c) - added("uncapped", c) for c in (T, 2 * T, 3 * T, 4 * T, 6 * T)]
    assert all(g >= -1e-12 for g in gaps), gaps
    assert max(gaps) > 0, gaps  # and strictly more somewhere on every link
