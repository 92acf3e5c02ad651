"""Migration planning (pure data) and the straggler monitor's hysteresis."""
from __future__ import annotations

from fractions import Fraction

import pytest

from impl.common.parallel.migration import buckets, held_units, migration_time_s, plan_migration
from impl.common.parallel.plan import Group, Plan, PipelinePlan, uniform_plan
from impl.malleus.straggler import StragglerMonitor, probe_baseline


def _tiles(plan: Plan, transfers, old: Plan):
    """After migration, every needed (unit, shard) is covered by reuse or received pieces."""
    have, need = held_units(old), held_units(plan)
    got = {}
    for t in transfers:
        got.setdefault((t.dst, t.unit), []).append((t.lo, t.hi))
        assert t.unit in have[t.src] and have[t.src][t.unit][0] <= t.lo and t.hi <= have[t.src][t.unit][1]
    for dst, units in need.items():
        for u, (lo, hi) in units.items():
            pieces = sorted(got.get((dst, u), []))
            if u in have.get(dst, {}):
                a, b = have[dst][u]
                pieces = sorted(pieces + [(max(a, lo), min(b, hi))] if a < hi and lo < b else pieces)
            cur = lo
            for a, b in pieces:
                assert a <= cur
                cur = max(cur, b)
            assert cur >= hi, (dst, u, pieces)


def test_same_plan_moves_nothing():
    p = uniform_plan(8, 4, 2, 2, 2, 8, 8)
    tr, s = plan_migration(p, p, lambda u: 100.0)
    assert tr == [] and s["bytes_moved"] == 0 and s["bytes_reused"] > 0


def test_tp_shards_tile_and_prefer_same_node():
    old = uniform_plan(8, 4, 2, 2, 2, 8, 8)  # stage 0 on node 0, stage 1 on node 1
    # new: pipeline 0's stage 0 shrinks to GPU 0 alone (tp 1), GPU 1 suspended
    g = list(old.groups)
    groups = (Group((0,), 0), g[1], g[2], g[3])
    new = Plan(8, 4, 2, 8, 8, groups, (PipelinePlan((0, 2), (2, 6), 3), PipelinePlan((1, 3), (4, 4), 5)), (1,))
    tr, s = plan_migration(old, new, lambda u: 64.0)
    _tiles(new, tr, old)
    # GPU 0 needs the other half of layers 0-1 (held by GPUs 1 and 3 on its node): intra-node
    to0 = [t for t in tr if t.dst == 0]
    assert to0 and all(t.src in (1, 3) and not t.inter_node and t.lo == Fraction(1, 2) for t in to0)
    # GPUs 4, 5 need layers 2-3 from stage 0 holders on node 0: inter-node
    assert any(t.inter_node for t in tr if t.dst in (4, 5))
    assert migration_time_s(tr, 100.0, 10.0) > 0


def test_buckets_bound_bytes_per_pair():
    old = uniform_plan(4, 1, 2, 1, 2, 8, 16)
    new = Plan(4, 1, 1, 8, 16, old.groups,
               (PipelinePlan(old.pipelines[0].groups, (2, 6), 6), PipelinePlan(old.pipelines[1].groups, (6, 2), 10)), ())
    tr, _ = plan_migration(old, new, lambda u: 10.0)
    rounds = buckets(tr, 25.0)
    assert sorted((t.unit, t.dst) for r in rounds for t in r) == sorted((t.unit, t.dst) for t in tr)
    for r in rounds:
        per = {}
        for t in r:
            per[(t.src, t.dst)] = per.get((t.src, t.dst), 0.0) + t.nbytes
        assert max(per.values()) <= 25.0


def test_monitor_hysteresis_and_triggers():
    mon = StragglerMonitor(4, window=2, check_every=3, replan_delta=0.3)
    for _ in range(2):
        for g, x in enumerate([3.0, 1.0, 1.0, 1.0]):
            mon.observe_active(g, 0.03 * x * 4 * 8, 4, 8, 1.0)
    mon.calibrate()
    x = mon.rates()
    assert x == pytest.approx([3.0, 1.0, 1.0, 1.0])
    snap = list(x)
    assert not mon.replan_due([3.2, 1.0, 1.1, 1.19], snap, [])  # < 0.3 and under 1.2
    assert mon.replan_due([2.7, 1.0, 1.0, 1.0], snap, [])
    assert not mon.replan_due([1.0, 1.0, 1.0, 1.0], [1.1, 1.0, 1.15, 0.8], [])  # all count as healthy
    assert mon.replan_due([1.0, 1.1, 1.0, 1.0], [1.0, 5.0, 1.0, 1.0], [1])  # suspended GPU recovered
    assert not mon.replan_due([1.0, 3.0, 1.0, 1.0], [1.0, 5.0, 1.0, 1.0], [1])  # still slow: identical
    assert mon.cache_key([1.0, 3.0, 1.1, 1.0], [1]) == mon.cache_key([1.0, 7.0, 1.0, 1.0], [1])
    assert probe_baseline([9.0, 1.0, 1.0, 2.0, 2.0]) == 1.5
