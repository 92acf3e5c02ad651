"""The baselines two papers share (impl/common/baselines): typed configs that refuse bad values in
one line, the static search's tie rule, the bucket search's two enumerations."""
from __future__ import annotations

import itertools

import pytest

from impl.common.baselines.hotspa_like import BucketSearch, halving_boundaries
from impl.common.baselines.megatron_grid import GridRuleConfig
from impl.common.baselines.static import StaticGridConfig, fastest, mean_step_s
from impl.common.errors import ConfigError


@pytest.mark.parametrize("make, msg", [
    (lambda: StaticGridConfig(parallel="cp"), "system.parallel: unknown 'cp' (one of: tp, ulysses)"),
    (lambda: StaticGridConfig(max_tp=0, field="system.sim.megatron_max_tp"), "system.sim.megatron_max_tp: must be >= 1, got 0"),
    (lambda: BucketSearch(order="random"), "system.sim.bucket_order: unknown 'random' (one of: mask, size)"),
    (lambda: BucketSearch(max_groups=-1), "system.sim.plan_max_groups: must be >= 0 (0 = every merge), got -1"),
    (lambda: BucketSearch(tolerance_s=-1.0), "system.sim.bucket_tolerance_s: must be >= 0, got -1.0"),
    (lambda: GridRuleConfig(token_budget_steps="yes"), "system.sim.token_budget_steps: must be true or false, got 'yes'"),
])
def test_bad_config_is_one_line_naming_the_field(make, msg):
    with pytest.raises(ConfigError) as e:
        make()
    assert str(e.value) == msg


def test_fastest_ties_to_the_earlier_layout_and_keeps_every_score():
    best, scores = fastest([("a", 3.0), ("b", 1.0), ("c", 1.0), ("d", 2.0)], lambda x: x)
    assert best == 1.0 and scores == {"a": 3.0, "b": 1.0, "c": 1.0, "d": 2.0}
    best, scores = fastest([("x", ("x", 2.0)), ("y", ("y", 2.0))], lambda lay: lay[1])
    assert best == ("x", 2.0)
    assert fastest([], lambda x: x) == (None, {})
    assert mean_step_s(lambda b: b, [0.1, 0.2, 0.4]) == pytest.approx(0.7 / 3)


def test_halving_boundaries_default_and_given():
    assert halving_boundaries(16384, []) == [16384, 8192, 4096, 2048, 0]
    assert halving_boundaries(16384, [32768, 4096]) == [32768, 4096, 0]
    with pytest.raises(ConfigError, match=r"^system.sim.hotspa_boundaries: \[4096, 8192\] must be descending"):
        halving_boundaries(8192, [4096, 8192])


def test_merges_enumerate_every_subset_in_each_order():
    inner = [8192, 4096, 2048]
    mask = list(BucketSearch(order="mask").merges(16384, inner))
    size = list(BucketSearch(order="size").merges(16384, inner))
    every = [[16384, *c, 0] for k in range(4) for c in itertools.combinations(inner, k)]
    assert len(mask) == 8 and sorted(mask) == sorted(every) and size == every
    assert mask[:3] == [[16384, 0], [16384, 8192, 0], [16384, 4096, 0]]
    # at most two groups = at most one cut, in either order
    assert sorted(BucketSearch(max_groups=2, order="mask").merges(16384, inner)) == sorted(every[:4])
    assert list(BucketSearch(max_groups=2, order="size").merges(16384, inner)) == every[:4]


def test_search_picks_the_fastest_merge_asking_each_range_once():
    asked = []

    def choose(lo, hi):
        asked.append((lo, hi))
        return f"s{hi}"

    # one cut at 4096 is fastest; the two-cut set ties it within the tolerance and loses
    times = {(16384, 0): 3.0, (16384, 8192, 0): 2.5, (16384, 4096, 0): 2.0, (16384, 8192, 4096, 0): 2.0 - 1e-13}
    for order in ("mask", "size"):
        asked.clear()
        t, b, strat, tried = BucketSearch(order=order, tolerance_s=1e-12).search(
            16384, [8192, 4096], choose, lambda b, s: times[tuple(b)])
        assert (t, b, strat, tried) == (2.0, [16384, 4096, 0], ["s16384", "s4096"], 4)
        assert len(asked) == len(set(asked)) == 6  # (lo, hi) ranges of the four sets
    t, b, _, _ = BucketSearch(order="size").search(16384, [8192, 4096], choose, lambda b, s: times[tuple(b)])
    assert b == [16384, 8192, 4096, 0]  # no tolerance: strictly faster wins
