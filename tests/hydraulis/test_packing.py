"""Stage 2 packing: the ILP's optimum against exhaustive search, capacity, bounds."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from impl.common.api import ConfigError
from impl.hydraulis.cost.strategy import ReplicaCost
from impl.hydraulis.packing import pack_replica, packing_score, v_range

R = ReplicaCost(2, 2, 1.0e-6, 0.049, 31.9, 2048, 1024)


def brute(lengths, r, v_window):
    """Smallest score over every assignment of the sequences to v labelled micro-batches."""
    v_lo, v_hi = v_range(sum(lengths), len(lengths), r, v_window)
    best = math.inf
    for v in range(v_lo, v_hi + 1):
        for lab in itertools.product(range(v), repeat=len(lengths)):
            mbs = [[i for i, j in enumerate(lab) if j == k] for k in range(v)]
            if any(sum(lengths[i] for i in mb) > r.cap for mb in mbs):
                continue
            best = min(best, packing_score(lengths, [mb for mb in mbs if mb], r))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ilp_packing_is_optimal_on_small_inputs(seed):
    L = np.random.default_rng(seed).integers(100, 1500, size=6).tolist()
    p = pack_replica(L, range(6), R, v_window=16, time_limit_s=10, mip_rel_gap=0.0)
    assert p.score == pytest.approx(brute(L, R, 16), rel=1e-9)
    assert p.lower_bound <= p.score + 1e-9
    assert p.status in ("optimal", "optimal_bound")


def test_packing_keeps_every_sequence_whole_and_under_capacity():
    L = np.random.default_rng(5).integers(10, 2048, size=40).tolist()
    idx = list(range(0, 40, 2))
    p = pack_replica(L, idx, R, time_limit_s=2)
    assert sorted(i for mb in p.micro_batches for i in mb) == idx
    assert all(sum(L[i] for i in mb) <= R.cap for mb in p.micro_batches)
    assert p.v == len(p.micro_batches)
    assert p.score == pytest.approx(packing_score(L, p.micro_batches, R))
    z = max(sum(R.seq_cost(L[i]) for i in mb) for mb in p.micro_batches)
    assert p.z == pytest.approx(z)
    costs = [sum(R.seq_cost(L[i]) for i in mb) for mb in p.micro_batches]
    assert costs == sorted(costs, reverse=True)  # run largest first


def test_v_window_bounds_the_micro_batch_count():
    r = ReplicaCost(1, 4, 9.5e-7, 0.045, 14.3, 4096, 64)
    L = [128] * 64  # util 64 allows up to 64 micro-batches; the window stops at v_min + 1
    p = pack_replica(L, range(64), r, v_window=2)
    v_lo = math.ceil(sum(L) / r.cap)
    assert v_lo <= p.v <= v_lo + 1


def test_bad_packing_inputs_are_one_line():
    with pytest.raises(ConfigError, match="received no sequences"):
        pack_replica([100], [], R)
    with pytest.raises(ConfigError, match="a sequence of 3000 tokens exceeds replica"):
        pack_replica([3000], [0], R)
    with pytest.raises(ConfigError, match="system.v_window: must be >= 1"):
        pack_replica([100], [0], R, v_window=0)
