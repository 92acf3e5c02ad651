"""MILP oracle of the scheduler gap (scenario S8, impl/adaptra/README.md)."""
import itertools
import random

import pytest

from impl.adaptra.adapt import adapt_warmup
from impl.adaptra.milp import replay_order, solve_pipeline_milp
from impl.adaptra.milp_gap import scheduler_gap
from impl.common.api import ConfigError
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.ir import Action, Op
from impl.common.schedule.list_scheduler import build_timeline
from impl.common.schedule.validate import peak_inflight, validate_schedule


def _check_valid(res, S, N):
    validate_schedule(insert_comm(res.schedule), S, N, split_backward=True, memory_limit=res.memory_limit)
    assert res.bound_s <= res.makespan_s + 1e-12
    assert res.gap >= 0


def test_single_stage_is_serial():
    tF, tB, tW = [0.3], [0.5], [0.2]
    res = solve_pipeline_milp(tF, tB, tW, [], 4)
    assert res.status == "optimal"
    assert res.makespan_s == pytest.approx(4 * (0.3 + 0.5 + 0.2), abs=1e-9)
    _check_valid(res, 1, 4)


def test_two_stages_two_microbatches_by_hand():
    # Stage 1 cannot start before t (F0 of stage 0) and holds 6t of work: >= 7t. Achieved by
    # stage 1: F0 B0 F1 B1 W0 W1 (1..7), stage 0: F0 F1 _ B0 W0 B1 W1 (0..7).
    t = 0.01
    res = solve_pipeline_milp([t, t], [t, t], [t, t], [0.0], 2)
    assert res.status == "optimal"
    assert res.makespan_s == pytest.approx(7 * t, abs=1e-9)
    _check_valid(res, 2, 2)


def test_single_microbatch_pays_the_delay_twice():
    # F0 F1 B1 B0 W0 is one chain crossing the slow link twice: 5t + 2c.
    t, c = 0.01, 0.025
    res = solve_pipeline_milp([t, t], [t, t], [t, t], [c], 1)
    assert res.makespan_s == pytest.approx(5 * t + 2 * c, abs=1e-9)


def test_memory_limit_one_serialises_microbatches():
    # One activation per stage: F1 on stage 0 waits for B0 there; critical chain
    # F0 F0' B0' B0 F1 F1' B1' B1 W1 = 9t.
    t = 0.01
    res = solve_pipeline_milp([t, t], [t, t], [t, t], [0.0], 2, memory_limit=[1, 1])
    assert res.makespan_s == pytest.approx(9 * t, abs=1e-9)
    assert max(peak_inflight(res.schedule).values()) == 1
    _check_valid(res, 2, 2)


def _all_orders(N):
    """Every per-stage order with F_j < B_j < W_j for each j (micro-batches in any order)."""
    for seq in set(itertools.permutations([j for j in range(N) for _ in range(3)])):
        seen = [0] * N
        row = []
        for j in seq:
            row.append(Action((Op.F, Op.B, Op.W)[seen[j]], j))
            seen[j] += 1
        yield row


@pytest.mark.parametrize("S,N,seed,mem", [(2, 2, 0, None), (2, 2, 1, [1, 1]), (3, 2, 2, None)])
def test_matches_brute_force_over_all_orders(S, N, seed, mem):
    # Exhaustive search does not assume in-order micro-batches, so this checks the
    # fixed-order w.l.o.g. argument as well as the model.
    rng = random.Random(seed)
    tF = [rng.uniform(0.5, 1.5) for _ in range(S)]
    tB = [rng.uniform(0.5, 2.0) for _ in range(S)]
    tW = [rng.uniform(0.3, 1.5) for _ in range(S)]
    c = [rng.uniform(0.0, 3.0) for _ in range(S - 1)]
    orders = list(_all_orders(N))
    best = float("inf")
    for combo in itertools.product(orders, repeat=S):
        sched = dict(enumerate(combo))
        if mem is not None and any(peak_inflight(sched)[s] > mem[s] for s in range(S)):
            continue
        try:
            best = min(best, replay_order(sched, tF, tB, tW, c)[1])
        except ConfigError:  # deadlocking order
            continue
    res = solve_pipeline_milp(tF, tB, tW, c, N, memory_limit=mem, mip_rel_gap=0.0)
    assert res.status == "optimal"
    assert res.makespan_s == pytest.approx(best, abs=1e-9)


@pytest.mark.parametrize("S,N", [(3, 6), (4, 8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_milp_lower_bounds_the_builder(S, N, seed):
    rng = random.Random(seed)
    t = 0.01
    ts = [t] * S
    c = [rng.uniform(0.0, 6 * t) for _ in range(S - 1)]
    warmup = adapt_warmup(ts, ts, c, N)
    tl = build_timeline(ts, ts, ts, c, warmup, num_microbatches=N)
    _, builder_exact = replay_order(tl.schedule, ts, ts, ts, c)
    # builder's timeline rounds delays up to its step, so it is >= the exact replay
    assert builder_exact <= tl.makespan_s + 1e-12
    res = solve_pipeline_milp(ts, ts, ts, c, N, memory_limit=warmup, time_limit_s=20)
    assert res.status == "optimal"
    assert res.makespan_s <= builder_exact + 1e-9
    _check_valid(res, S, N)


def test_time_limit_reports_bound_honestly():
    # Heterogeneous op times make the big-M model hard; 1 s is far too little for S=6, N=18.
    rng = random.Random(4)
    S, N = 6, 18
    tF = [rng.uniform(0.5, 1.5) for _ in range(S)]
    tB = [rng.uniform(0.5, 2) for _ in range(S)]
    tW = [rng.uniform(0.3, 1.5) for _ in range(S)]
    c = [rng.choice([0, 0, rng.uniform(0, 5)]) for _ in range(S - 1)]
    res = solve_pipeline_milp(tF, tB, tW, c, N, time_limit_s=1.0)
    assert res.status == "time_limit" and not res.optimal
    assert res.bound_s < res.makespan_s and res.gap > 0
    _check_valid(res, S, N)


def test_scheduler_gap_s8_smallest():
    r = scheduler_gap(3, 6)  # default: uniform 10 ms ops, 30 ms on link (0, 1)
    assert r["milp_status"] == "optimal"
    assert r["c"] == [0.03, 0.0]
    assert r["gap"] >= -1e-9  # the MILP optimises over every schedule the builder could produce
    assert r["gap_upper"] >= r["gap"] - 1e-12
    # builder timeline, exact replay and the pipeline simulator agree on the builder's order
    assert r["builder_timeline_s"] == pytest.approx(r["builder_s"], abs=1e-9)
    assert r["sim_s"] == pytest.approx(r["builder_s"], abs=1e-9)


@pytest.mark.parametrize("call,field", [
    (lambda: solve_pipeline_milp([0.01, -0.01], [0.01] * 2, [0.01] * 2, [0.0], 2), "tF[1]"),
    (lambda: solve_pipeline_milp([0.01] * 2, [0.01] * 3, [0.01] * 2, [0.0], 2), "tB"),
    (lambda: solve_pipeline_milp([0.01] * 2, [0.01] * 2, [0.01] * 2, [0.0, 0.0], 2), "c"),
    (lambda: solve_pipeline_milp([0.01] * 2, [0.01] * 2, [0.01] * 2, [-1.0], 2), "c[0]"),
    (lambda: solve_pipeline_milp([0.01] * 2, [0.01] * 2, [0.01] * 2, [0.0], 0), "num_microbatches"),
    (lambda: solve_pipeline_milp([0.01] * 2, [0.01] * 2, [0.01] * 2, [0.0], 2, memory_limit=[1]),
     "memory_limit"),
    (lambda: solve_pipeline_milp([0.01] * 2, [0.01] * 2, [0.01] * 2, [0.0], 2, memory_limit=[2, 0]),
     "memory_limit[1]"),
    (lambda: solve_pipeline_milp([], [], [], [], 2), "tF"),
    (lambda: scheduler_gap(3, 6, t_op_s=-1.0), "t_op_s"),
    (lambda: scheduler_gap(3, 6, c=[0.0]), "c"),
    (lambda: scheduler_gap(3, 6, memory="some"), "memory"),
])
def test_bad_input_one_line_error(call, field):
    with pytest.raises(ConfigError) as exc:
        call()
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(field)


def test_initial_schedule_seeds_the_incumbent():
    t, S, N = 0.01, 3, 6
    ts, c = [t] * S, [0.02, 0.0]
    warmup = adapt_warmup(ts, ts, c, N)
    tl = build_timeline(ts, ts, ts, c, warmup, num_microbatches=N)
    res = solve_pipeline_milp(ts, ts, ts, c, N, memory_limit=warmup, initial_schedule=tl.schedule)
    assert res.heuristic_s <= replay_order(tl.schedule, ts, ts, ts, c)[1] + 1e-12
    assert res.makespan_s <= res.heuristic_s + 1e-12
    with pytest.raises(ConfigError, match="memory limit"):
        solve_pipeline_milp(ts, ts, ts, c, N, memory_limit=[1, 1, 1], initial_schedule=tl.schedule)
