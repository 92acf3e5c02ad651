"""Offline strategy generator: the DP against brute force, the pool's shape, bad input."""
from __future__ import annotations

import numpy as np
import pytest

from impl.common.api import ConfigError
from impl.hydraulis.cost.strategy import ReplicaCost
from impl.hydraulis.generator import Histogram, brute_force, dp_table, generate_pool

SMALL = [ReplicaCost(1, 1, 1e-6, 0.05, 10, 256, 1), ReplicaCost(2, 1, 5e-7, 0.03, 20, 512, 1),
         ReplicaCost(1, 2, 5e-7, 0.026, 8, 768, 1)]


@pytest.mark.parametrize("seed,n", [(0, 4), (1, 4), (2, 3), (3, 5)])
def test_dp_equals_brute_force(seed, n):
    x = np.random.default_rng(seed).integers(1, 6 * 128, size=10)
    h = Histogram.from_lengths(x, 128)
    ml = [r.cap for r in SMALL]
    t, _ = dp_table(h, SMALL, n, ml)
    for s in range(1, h.buckets + 1):
        assert t[n][s] == pytest.approx(brute_force(h, SMALL, n, ml, s))


def test_pool_layout_first_lists_use_every_gpu_and_are_unique(costs7b):
    rng = np.random.default_rng(0)
    x = np.clip(np.rint(rng.lognormal(np.log(700), 1.25, 400)), 1, 16384).astype(int)
    h = Histogram.from_lengths(x, 128, weight=0.25)
    strategies = sorted(costs7b.values(), key=lambda r: (r.gpus, r.tp))
    layout = [costs7b[(4, 1)]] * 8
    pool = generate_pool(h, strategies, 32, layout, max_candidates=6)
    assert pool.candidates[0] == layout and pool.sources[0] == "optimizer_layout"
    assert 2 <= len(pool.candidates) <= 1 + 6  # the layout plus at least one DP list, capped at max_candidates
    keys = [tuple(sorted((r.tp, r.pp) for r in c)) for c in pool.candidates]
    assert len(set(keys)) == len(keys)
    for c in pool.candidates:
        assert sum(r.gpus for r in c) == 32
    assert max(r.cap for r in pool.candidates[1]) >= int(x.max())  # the largest-s list holds the longest
    assert all(line.startswith(f"{i}: ") for i, line in enumerate(pool.describe()))


def test_negative_histogram_count_is_one_line():
    with pytest.raises(ConfigError, match=r"generator histogram: count of length 300 is negative \(-2\)"):
        Histogram.from_counts([100, 300], [5, -2], 128)


def test_pool_that_cannot_hold_the_longest_sequence(costs7b):
    h = Histogram.from_lengths([200_000, 100], 128)
    with pytest.raises(ConfigError, match=r"strategy pool: no strategy holds the longest sequence \(200000 tokens"):
        generate_pool(h, list(costs7b.values()), 32, [costs7b[(4, 1)]] * 8)
