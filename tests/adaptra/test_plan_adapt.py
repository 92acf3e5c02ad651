"""Alg. 1 (initial plan) and Alg. 2 (slack adaptation): hand-computed values and invariants."""
from __future__ import annotations

import math
import random

import pytest

from impl.adaptra.adapt import FORMULAS, adapt_warmup, slack
from impl.adaptra.builder import adaptra_schedule
from impl.common.api import ConfigError
from impl.common.schedule.generators import one_f_one_b, one_f_one_b_warmup
from impl.common.schedule.ir import Op
from impl.common.schedule.warmup import initial_warmup

MS = 1e-3


# ---- Alg. 1 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("S,x_max,expected", [
    (4, 8, [8, 5, 3, 1]),        # Δavg = 7//3 = 2, r = 1: the first link gets 3
    (4, 7, [7, 5, 3, 1]),        # r = 0: slack 2 everywhere (the ZB baseline quotas)
    (5, 9, [9, 7, 5, 3, 1]),
    (3, 10, [10, 5, 1]),         # Δavg = 4, r = 1
    (4, 3, [3, 2, 1, 1]),        # x_max < S: Δavg = 0, r = 2
    (1, 6, [6]),
])
def test_initial_warmup_examples(S, x_max, expected):
    assert initial_warmup(S, x_max) == expected


@pytest.mark.parametrize("S", range(2, 9))
@pytest.mark.parametrize("x_max", range(1, 25))
def test_initial_warmup_maximises_min_slack(S, x_max):
    x = initial_warmup(S, x_max)
    slacks = [a - b for a, b in zip(x, x[1:])]
    assert x[0] == x_max and x[-1] == 1
    assert min(slacks) == (x_max - 1) // (S - 1)  # no split of x_max - 1 over S - 1 links does better
    assert max(slacks) - min(slacks) <= 1
    assert slacks == sorted(slacks, reverse=True)  # the extra units go to the first r links


@pytest.mark.parametrize("S,x_max,frag", [(0, 4, "num_stages must be >= 1"), (3, 0, "x_max .* must be >= 1")])
def test_initial_warmup_rejects(S, x_max, frag):
    with pytest.raises(ConfigError, match=frag):
        initial_warmup(S, x_max)


# ---- Alg. 2 ----------------------------------------------------------------------------------

def uniform(S, t=10 * MS):
    return [t] * S, [t] * S


@pytest.mark.parametrize("c0_ms,expected", [
    (0, [7, 5, 3, 1]),     # Δ = max(ceil(20/20), 2) = 2
    (10, [7, 5, 3, 1]),    # ceil(40/20) = 2
    (30, [9, 5, 3, 1]),    # ceil(80/20) = 4
    (60, [12, 5, 3, 1]),   # ceil(140/20) = 7
])
def test_paper_formula_first_link(c0_ms, expected):
    tF, tB = uniform(4)
    assert adapt_warmup(tF, tB, [c0_ms * MS, 0, 0], 24, formula="paper") == expected


def test_paper_formula_last_link_and_uneven_times():
    # link (2,3) slow, stage 3 twice as fast: Δ_2 = ceil((10+20+2*25)/(5+10)) = ceil(5.33) = 6
    tF, tB = [10 * MS] * 3 + [5 * MS], [20 * MS] * 3 + [10 * MS]
    x = adapt_warmup(tF, tB, [0, 0, 25 * MS], 40)
    assert x == [11, 9, 7, 1]  # Δ_0 = Δ_1 = max(ceil(30/30), 2) = 2


def test_paper_formula_caps_slack_at_n_minus_2s():
    tF, tB = uniform(4)
    # N = 12: N - 2S = 4 caps the 7 that c = 60 ms would need
    assert adapt_warmup(tF, tB, [60 * MS, 0, 0], 12, formula="paper") == [9, 5, 3, 1]


@pytest.mark.parametrize("N,expected", [(8, [7, 5, 3, 1]), (5, [5, 5, 3, 1]), (2, [2, 2, 2, 1]), (1, [1, 1, 1, 1])])
def test_small_n_floors_slack_at_two_then_clips_to_n(N, expected):
    # N - 2S <= 0 here: the paper's clip would give slack <= 0; we floor at 2, then clip x to N
    tF, tB = uniform(4)
    assert adapt_warmup(tF, tB, [60 * MS, 0, 0], N, formula="paper") == expected


@pytest.mark.parametrize("c0_ms,delta0", [(0, 2), (5, 3), (25, 5), (60, 8)])
def test_artifact_formula(c0_ms, delta0):
    tF, tB = uniform(4)
    x = adapt_warmup(tF, tB, [c0_ms * MS, 0, 0], 100, formula="artifact")
    assert x == [5 + delta0, 5, 3, 1]  # Δ_0 = ceil(c/tF) + 2, not capped by N - 2S


def test_artifact_formula_is_only_clipped_by_n():
    tF, tB = uniform(4)
    assert adapt_warmup(tF, tB, [60 * MS, 0, 0], 12, formula="artifact") == [12, 5, 3, 1]
    assert adapt_warmup(tF, tB, [60 * MS, 0, 0], 11, formula="artifact") == [11, 5, 3, 1]


def test_ceiling_tolerates_float_noise():
    # (0.1 + 0.2) / 0.1 = 3.0000000000000004 in floating point: the slack must be 3, not 4
    assert slack([0.1, 0.05], [0.2, 0.05], [0.0], 0, 10) == 3
    # 0.06 / 0.02 = 2.9999999999999996: still 3
    assert slack([0.01, 0.01], [0.01, 0.01], [0.02], 0, 30) == 3


@pytest.mark.parametrize("formula", FORMULAS)
@pytest.mark.parametrize("seed", range(40))
def test_adapt_invariants_random(formula, seed):
    rng = random.Random(seed)
    S = rng.randint(1, 9)
    N = rng.randint(1, 4 * S)
    tF = [rng.uniform(2, 20) * MS for _ in range(S)]
    tB = [rng.uniform(2, 40) * MS for _ in range(S)]
    c = [rng.choice([0.0, rng.uniform(0, 80) * MS]) for _ in range(S - 1)]
    x = adapt_warmup(tF, tB, c, N, formula=formula)
    assert len(x) == S
    assert x[-1] == 1 and x[0] <= N
    assert all(a >= b for a, b in zip(x, x[1:]))  # lemma: non-increasing
    for i in range(S - 1):
        if x[i] < N:  # not clipped: slack at least 2 and what the formula asked for
            assert x[i] - x[i + 1] >= 2
            assert x[i] - x[i + 1] == slack(tF, tB, c, i, N, formula)
        if formula == "paper" and x[i] < N and N - 2 * S >= 2:
            need = (tF[i] + tB[i] + 2 * c[i]) / (tF[i + 1] + tB[i + 1])
            # no-cascade condition of §2.1 holds unless the N - 2S cap bit
            assert x[i] - x[i + 1] >= min(N - 2 * S, math.ceil(need - 1e-9))


@pytest.mark.parametrize("kwargs,frag", [
    (dict(formula="milp"), "formula 'milp' is unknown"),
    (dict(c=[0.0]), "c has 1 entries, expected 2"),
    (dict(tB=[0.01, 0.01]), "tB has 2 entries, expected 3"),
    (dict(tF=[0.01, 0.0, 0.01]), r"tF\[1\] = 0.0 must be finite and > 0"),
    (dict(c=[0.0, -0.01]), r"c\[1\] = -0.01 must be finite and >= 0"),
    (dict(num_microbatches=0), "num_microbatches must be an integer >= 1"),
])
def test_adapt_rejects_bad_input(kwargs, frag):
    args = dict(tF=[0.01] * 3, tB=[0.01] * 3, c=[0.0, 0.0], num_microbatches=9)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=frag):
        adapt_warmup(**args)


# ---- warm-up counts as the schedules realise them ----------------------------------------

@pytest.mark.parametrize("S,N", [(4, 8), (3, 3), (5, 12), (2, 1)])
def test_1f1b_warmup_counts(S, N):
    assert one_f_one_b_warmup(S, N) == [min(S - i - 1, N) for i in range(S)]
    for s, row in one_f_one_b(S, N).items():
        first_bw = next(k for k, a in enumerate(row) if a.op is Op.BW)
        assert first_bw == min(S - s - 1, N) + (1 if S - s - 1 < N else 0)
        assert all(a.op is Op.F for a in row[:first_bw])


@pytest.mark.parametrize("formula", FORMULAS)
@pytest.mark.parametrize("seed", range(10))
def test_first_x_ops_of_each_stage_are_forwards(formula, seed):
    rng = random.Random(1000 + seed)
    S = rng.randint(2, 6)
    N = rng.randint(S, 3 * S)
    t = [rng.uniform(5, 15) * MS for _ in range(S)]
    c = [rng.uniform(0, 50) * MS for _ in range(S - 1)]
    sched, x = adaptra_schedule(t, t, t, c, N, formula=formula)
    for s in range(S):
        ops = [a.op for a in sched[s]]
        assert ops[:x[s]] == [Op.F] * x[s]
        if x[s] < N:  # with the in-flight limit the warm-up is exactly x_i forwards
            assert ops[x[s]] is Op.B
