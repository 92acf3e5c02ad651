"""Alg. 3/4 list scheduler: valid schedules, event-driven == stepped, bounded, expected shape."""
from __future__ import annotations

import math
import random

import pytest

from impl.adaptra.adapt import adapt_warmup
from impl.adaptra.builder import adaptra_schedule
from impl.common.api import ConfigError
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import zb_warmup, zero_bubble
from impl.common.schedule.ir import Op, format_schedule
from impl.common.schedule.list_scheduler import build_schedule, build_timeline
from impl.common.schedule.validate import ScheduleError, peak_inflight, validate_schedule

MS = 1e-3
GRID = [(S, N) for S in range(1, 7) for N in range(S, 3 * S + 1, 2)]


def random_case(seed: int, max_s: int = 6):
    rng = random.Random(seed)
    S = rng.randint(1, max_s)
    N = rng.randint(1, 3 * S)
    tF = [rng.uniform(5, 15) * MS for _ in range(S)]
    tB = [rng.uniform(5, 20) * MS for _ in range(S)]
    tW = [rng.uniform(3, 15) * MS for _ in range(S)]
    c = [rng.choice([0.0, 0.0, rng.uniform(0, 60) * MS]) for _ in range(S - 1)]
    return S, N, tF, tB, tW, c


def check_schedule(sched, S, N, warmup):
    validate_schedule(sched, S, N, split_backward=True, warmup_quota=warmup)
    validate_schedule(insert_comm(sched), S, N, split_backward=True)
    validate_schedule(insert_comm(sched, blocking_sends=True), S, N, blocking_sends=True)
    for s, x in enumerate(warmup):  # the first x_i ops of stage i are F
        assert all(a.op is Op.F for a in sched[s][:x]), f"stage {s}: {sched[s][:x]}"


@pytest.mark.parametrize("S,N", GRID)
def test_uniform_no_delay_is_valid(S, N):
    t = [10 * MS] * S
    sched, warmup = adaptra_schedule(t, t, t, [0.0] * (S - 1), N)
    check_schedule(sched, S, N, warmup)


@pytest.mark.parametrize("formula", ["paper", "artifact"])
@pytest.mark.parametrize("seed", range(25))
def test_random_delays_are_valid(seed, formula):
    S, N, tF, tB, tW, c = random_case(seed)
    sched, warmup = adaptra_schedule(tF, tB, tW, c, N, formula=formula)
    check_schedule(sched, S, N, warmup)


@pytest.mark.parametrize("wait_first_backward", [True, False])
@pytest.mark.parametrize("limit_inflight", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_event_driven_equals_stepped(seed, wait_first_backward, limit_inflight):
    S, N, tF, tB, tW, c = random_case(100 + seed, max_s=5)
    warmup = adapt_warmup(tF, tB, c, N)
    kw = dict(num_microbatches=N, steps_per_op=6, wait_first_backward=wait_first_backward,
              limit_inflight=limit_inflight)
    ev = build_timeline(tF, tB, tW, c, warmup, method="event", **kw)
    st = build_timeline(tF, tB, tW, c, warmup, method="stepped", **kw)
    assert ev.schedule == st.schedule
    assert ev.start_step == st.start_step and ev.end_step == st.end_step
    validate_schedule(ev.schedule, S, N, split_backward=True)


@pytest.mark.parametrize("seed", range(10))
def test_finishes_within_bound(seed):
    S, N, tF, tB, tW, c = random_case(200 + seed)
    warmup = adapt_warmup(tF, tB, c, N)
    tl = build_timeline(tF, tB, tW, c, warmup, num_microbatches=N)
    t_o = max(tF + tB + tW)
    base = 3 * N * S * math.ceil(t_o / tl.delta_s - 1e-9)
    assert tl.makespan_steps <= tl.max_steps
    if not any(c):
        assert tl.max_steps == base  # 3·N·S·⌈t_o/δ⌉ when no link is slow
    assert tl.max_steps == base + 2 * N * sum(math.ceil(x / tl.delta_s - 1e-9) for x in c)


@pytest.mark.parametrize("method", ["event", "stepped"])
def test_gives_up_past_bound_instead_of_looping(method):
    t = [10 * MS] * 3
    with pytest.raises(ScheduleError, match="passed its bound of 50 steps without finishing: stage 0 ran"):
        build_timeline(t, t, t, [0.0, 0.0], [5, 3, 1], num_microbatches=6, method=method, max_steps=50)


@pytest.mark.parametrize("S,N", [(2, 4), (4, 8), (4, 12), (4, 24), (6, 18)])
def test_uniform_no_delay_shape(S, N):
    # The last stage cannot start before (S-1) forwards and then has 3N ops of work: the
    # greedy schedule reaches that lower bound with slack-2 quotas.
    t = 10 * MS
    warmup = zb_warmup(S, N)
    tl = build_timeline([t] * S, [t] * S, [t] * S, [0.0] * (S - 1), warmup, num_microbatches=N)
    assert tl.makespan_s == pytest.approx((S - 1) * t + 3 * N * t)
    assert peak_inflight(tl.schedule) == {s: warmup[s] for s in range(S)}
    for s in range(S):
        row = tl.schedule[s]
        x = warmup[s]
        assert [a.op for a in row[:x]] == [Op.F] * x
        if x < N:
            assert row[x].op is Op.B and row[x].mb == 0  # steady state starts with B0
        assert row[-1].op is Op.W  # deferred W's fill the drain


def test_zb_generator_matches_builder_and_expected_text():
    assert zero_bubble(4, 8) == build_schedule([1.0] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 3, [7, 5, 3, 1],
                                               num_microbatches=8, steps_per_op=1)
    # last stage of a uniform ZB pipeline: strict F/B alternation, all W at the end
    assert format_schedule(zero_bubble(4, 4)).splitlines()[3] == "3: F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3"


@pytest.mark.parametrize("S,N", [(2, 3), (4, 7), (4, 12), (5, 15)])
def test_zb_equals_adaptra_without_delay(S, N):
    t = [10 * MS] * S
    sched, warmup = adaptra_schedule(t, t, t, [0.0] * (S - 1), N)
    assert warmup == zb_warmup(S, N)
    assert sched == zero_bubble(S, N)


@pytest.mark.parametrize("c_ms", [0, 10, 20, 30, 40, 60])
def test_adapted_schedule_absorbs_delay(c_ms):
    # With Δ from Alg. 2 the paper's no-cascade condition holds, so a delay c on link (0,1)
    # costs at most c plus one step (our simulator reference [R], impl/adaptra/README.md:
    # 750..810 ms for t = 10 ms, N = 24).
    S, N, t = 4, 24, 10 * MS
    c = [c_ms * MS, 0.0, 0.0]
    warmup = adapt_warmup([t] * S, [t] * S, c, N)
    base = build_timeline([t] * S, [t] * S, [t] * S, [0.0] * 3, adapt_warmup([t] * S, [t] * S, [0.0] * 3, N),
                          num_microbatches=N)
    tl = build_timeline([t] * S, [t] * S, [t] * S, c, warmup, num_microbatches=N)
    assert tl.makespan_s - base.makespan_s <= c_ms * MS + tl.delta_s + 1e-12


def test_priority_b_over_f_over_w_hand_traced():
    # 2 stages, unit ops, c = 0, quota 1, no in-flight cap (the paper's spill-to-host mode), so
    # B, F and W compete once warm-up is over. Traced by hand: on stage 0 at t=3, B0 (back from
    # stage 1) and F3 are both ready -> B0; at t=4, F3 and W0 -> F3; at t=6, W0 and W1 -> W0.
    t = [1.0, 1.0]
    sched = build_schedule(t, t, t, [0.0], [1, 1], num_microbatches=4, steps_per_op=1,
                           limit_inflight=False, wait_first_backward=False)
    assert format_schedule(sched) == ("0: F0 F1 F2 B0 F3 B1 W0 B2 W1 B3 W2 W3\n"
                                      "1: F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3")


def test_wait_first_backward_knob():
    t = [10 * MS] * 2
    kw = dict(num_microbatches=4, limit_inflight=False)
    eager = build_schedule(t, t, t, [0.0], [1, 1], wait_first_backward=False, **kw)
    waits = build_schedule(t, t, t, [0.0], [1, 1], wait_first_backward=True, **kw)
    assert [str(a) for a in eager[0][:2]] == ["F0", "F1"]  # F1 runs before B0 comes back
    assert waits[0][1].op is Op.B and waits[0][1].mb == 0  # waits for the first B
    # the in-flight limit alone already stops the extra forward
    limited = build_schedule(t, t, t, [0.0], [1, 1], num_microbatches=4, wait_first_backward=False)
    assert limited[0][1].op is Op.B


def test_slower_link_gets_more_slack_and_stays_valid():
    S, N, t = 6, 18, 10 * MS
    c = [0.0, 0.0, 0.0, 0.0, 45 * MS]
    sched, warmup = adaptra_schedule([t] * S, [t] * S, [t] * S, c, N)
    slacks = [a - b for a, b in zip(warmup, warmup[1:])]
    assert slacks[-1] == max(slacks) > 2
    check_schedule(sched, S, N, warmup)


@pytest.mark.parametrize("kwargs,frag", [
    (dict(warmup=[3, 4, 1]), "warm-up quota 4 on stage 1 exceeds 3 on stage 0"),
    (dict(warmup=[7, 3, 1]), "warm-up quota 7 on stage 0 exceeds num_microbatches 6"),
    (dict(warmup=[3, 2, 0]), "warm-up quota 0 on stage 2 must be >= 1"),
    (dict(warmup=[3, 1]), "warmup has 2 entries, expected num_stages 3"),
    (dict(c=[0.0]), "c has 1 entries, expected 2"),
    (dict(tW=[0.01, -0.01, 0.01]), r"tW\[1\] = -0.01 must be finite and > 0"),
    (dict(method="magic"), "method must be 'event' or 'stepped'"),
    (dict(steps_per_op=0), "steps_per_op must be >= 1"),
    (dict(num_microbatches=0), "num_microbatches must be an integer >= 1, got 0"),
])
def test_builder_rejects_bad_input(kwargs, frag):
    args = dict(tF=[0.01] * 3, tB=[0.01] * 3, tW=[0.01] * 3, c=[0.0, 0.0], warmup=[3, 2, 1],
                num_microbatches=6)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=frag):
        build_timeline(**args)


@pytest.mark.slow
def test_large_pipeline_builds_fast():
    import time

    S, N, t = 128, 1024, 10 * MS
    c = [0.0] * (S - 2) + [30 * MS]
    start = time.perf_counter()
    sched, warmup = adaptra_schedule([t] * S, [t] * S, [t] * S, c, N)
    assert time.perf_counter() - start < 10.0  # ~1 s on one idle core
    assert sum(len(row) for row in sched.values()) == 3 * N * S
