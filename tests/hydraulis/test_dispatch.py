"""Stage 1 dispatch (spec 2.4, 9): coverage, capacity, tie rule, infeasibility, determinism."""
from __future__ import annotations

import math

import numpy as np
import pytest

from impl.hydraulis.cost import ReplicaCost
from impl.hydraulis.dispatch import dispatch, token_balanced

BIG = ReplicaCost(8, 1, 5e-7, 0.036, 44.0, 8192, 1024)
SMALL = ReplicaCost(1, 4, 9.5e-7, 0.045, 14.0, 2048, 384)


def _lengths(n=60, seed=0, hi=8192):
    return np.clip(np.rint(np.random.default_rng(seed).lognormal(np.log(700), 1.25, n)), 1, hi).astype(int).tolist()


def test_every_sequence_once_and_within_capacity():
    L = _lengths()
    reps = [SMALL, BIG, SMALL, SMALL]
    d = dispatch(L, reps, shuffles=20, seed=3)
    assert d.feasible
    flat = sorted(i for a in d.assign for i in a)
    assert flat == list(range(len(L)))
    for r, a in zip(reps, d.assign):
        assert a and all(L[i] <= r.cap for i in a)


def test_long_sequences_go_to_the_only_replica_that_fits():
    L = [5000, 6000, 100, 200, 300, 400]
    d = dispatch(L, [SMALL, BIG], shuffles=5)
    assert {0, 1} <= set(d.assign[1])


def test_tie_goes_to_the_last_empty_replica():
    """Spec 9: the 5000-token sequence fits BIG only and goes first; the first short sequence
    placed then ties (at the current maximum) on both empty SMALL replicas and goes to the
    LAST of them; the second fills the other."""
    L = [5000, 100, 100]
    d = dispatch(L, [BIG, SMALL, SMALL], shuffles=1, seed=0)
    first_short = [1, 2][int(np.random.default_rng([0, 0]).permutation(2)[0])]
    assert d.assign[0] == [0] and d.assign[2] == [first_short] and d.assign[1] == [3 - first_short]


def test_infeasible_when_a_replica_stays_empty_or_nothing_fits():
    assert not dispatch([10, 20], [SMALL, SMALL, SMALL], shuffles=3).feasible
    d = dispatch([9000], [SMALL, BIG], shuffles=3)
    assert not d.feasible and d.makespan == math.inf


def test_deterministic_per_seed_and_seed_matters():
    L = _lengths(80, seed=1)
    reps = [BIG, SMALL, SMALL, SMALL, SMALL]
    a = dispatch(L, reps, shuffles=10, seed=7)
    assert a == dispatch(L, reps, shuffles=10, seed=7)
    assert any(dispatch(L, reps, shuffles=1, seed=s).assign != dispatch(L, reps, shuffles=1, seed=0).assign
               for s in range(1, 6))


def test_more_shuffles_never_worse_and_makespan_recomputes():
    L = _lengths(80, seed=2)
    reps = [BIG, SMALL, SMALL, SMALL]
    one, many = dispatch(L, reps, shuffles=1, includes_c=False), dispatch(L, reps, shuffles=50, includes_c=False)
    assert many.makespan <= one.makespan
    span = max(sum(r.seq_cost(L[i]) for i in a) + max(r.seq_cost(L[i]) * (r.pp - 1) for i in a)
               for r, a in zip(reps, many.assign))
    assert many.makespan == pytest.approx(span)


def test_token_balanced_is_memory_balanced():
    L = _lengths(60, seed=4, hi=2048)
    d = token_balanced(L, [SMALL, SMALL, SMALL])
    toks = [sum(L[i] for i in a) for a in d.assign]
    assert max(toks) - min(toks) <= max(L)
