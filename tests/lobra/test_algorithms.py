"""Cost fit, dynamic bucketing, balanced dispatch ILP, planner (the invariants of impl/lobra/README.md "Tests"), brute-forced
on small inputs."""
import itertools

import numpy as np
import pytest

from impl.common.api import ConfigError
from impl.common.llm.lora_train import Sample
from impl.lobra import bucketing
from impl.lobra.cost.replica import Scheme, TpCost, fit_tp_cost, replica_time
from impl.lobra.dispatch import ReplicaGroup, balanced, even, group_time, length_based, split_samples
from impl.lobra.joint_step import plan_step
from impl.lobra.plan import multisets, plan, scheme_pool


def scheme(tp, pp, M, k=1.0, L=4):
    # per-GPU efficiency falls with tp (k > 1 shrinks it); c6 is a fixed per-micro-batch cost
    return Scheme(tp, pp, M, TpCost((1e-9 / tp * k, 0.0, 1e-5 / tp * k, 0.0, 0.0, 2e-4)), L)


def test_fit_tp_cost_recovers_coefficients():
    true = TpCost((2e-9, 1e-9, 3e-6, 1e-6, 5e-5, 1e-3))
    samples = [(m, s, true.f(m, s)) for m in (1, 4) for s in (256, 1024, 4096, 16384)]
    fit = fit_tp_cost(samples)
    for s in (300, 5000):
        for m in (1, 2, 4):
            assert fit.f(m, s) == pytest.approx(true.f(m, s), rel=1e-6)
    with pytest.raises(ConfigError, match="2 distinct mbs"):
        fit_tp_cost([(1, s, true.f(1, s)) for s in (1, 2, 3, 4, 5, 6)])


def brute_padding(lengths, B, align=16, cuts=()):
    cand = sorted(set(bucketing.candidates(lengths, align)) | {f for f in cuts if min(lengths) < f < max(lengths)})
    best = None
    for k in range(1, min(B, len(cand)) + 1):
        for sub in itertools.combinations(cand[:-1], k - 1):
            bs = list(sub) + [cand[-1]]
            lo = [0] + bs[:-1]
            if any(a < f < b for a, b in zip(lo, bs) for f in cuts):
                continue  # a bucket straddles a cut
            p = bucketing.padding(lengths, bs)
            best = p if best is None else min(best, p)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_dynamic_buckets_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    lengths = list(rng.integers(1, 400, size=int(rng.integers(3, 12))))
    for B in (1, 2, 3, 5):
        bs = bucketing.dynamic_buckets(lengths, B)
        assert len(bs) <= B and bs == sorted(set(bs))
        assert all(x <= b for x, b in zip(lengths, bucketing.assign(lengths, bs)))
        assert bucketing.padding(lengths, bs) == brute_padding(lengths, B)


@pytest.mark.parametrize("seed", range(6))
def test_dynamic_buckets_with_cuts_equal_brute_force(seed):
    # A replica's max_tokens is a cut: no bucket spans it, so every sequence that fits the
    # smaller replica stays in a bucket that fits it too.
    rng = np.random.default_rng(100 + seed)
    lengths = list(rng.integers(1, 400, size=int(rng.integers(4, 12))))
    cuts = [100, 250]
    for B in (3, 4, 6):
        bs = bucketing.dynamic_buckets(lengths, B, cuts=cuts)
        assert len(bs) <= B and bs == sorted(set(bs))
        for x, b in zip(lengths, bucketing.assign(lengths, bs)):
            assert x <= b and all(not (x <= f < b) for f in cuts)
        assert bucketing.padding(lengths, bs) == brute_padding(lengths, B, cuts=cuts)
    with pytest.raises(ConfigError, match="system.num_buckets: 2 buckets cannot keep the 2 replica max_tokens cuts"):
        bucketing.dynamic_buckets([50, 200, 390], 2, cuts=cuts)


def test_bucket_cuts_let_the_small_replica_take_what_fits_and_auto_keeps_the_better_plan():
    from impl.lobra.joint_step import plan_bucketed

    rng = np.random.default_rng(5)
    samples = [Sample("a", i, int(x)) for i, x in enumerate(rng.integers(16, 2048, size=40))]
    groups = [ReplicaGroup(scheme(2, 1, 2048, k=1.4), 1), ReplicaGroup(scheme(1, 1, 512), 1)]
    kw = dict(num_buckets=4, fixed=(), task_order=["a"])
    plans = {c: plan_bucketed(groups, samples, "dynamic", "balanced", cuts=c, **kw) for c in ("off", "on", "auto")}
    assert 512 in plans["on"].boundaries and plans["on"].info["bucket_cuts"] == [512, 2048]
    # with the cut, every sequence <= 512 sits in a bucket the 512-token replica can hold
    small = {(s.task, s.seq_id) for s in samples if s.length <= 512}
    assert all(b <= 512 for b, x in zip(bucketing.assign([s.length for s in samples], plans["on"].boundaries),
                                         samples) if (x.task, x.seq_id) in small)
    best = min(plans["off"].dispatch.objective_s, plans["on"].dispatch.objective_s)
    assert plans["auto"].dispatch.objective_s == pytest.approx(best)
    with pytest.raises(ConfigError, match="system.bucket_cuts: unknown 'both'"):
        plan_bucketed(groups, samples, "dynamic", "balanced", cuts="both", **kw)


def test_padding_falls_with_more_buckets_and_fixed_set():
    lengths = np.random.default_rng(0).lognormal(np.log(300), 1.0, 500).astype(int) + 1
    pads = [bucketing.padding(lengths, bucketing.dynamic_buckets(lengths, B)) for B in (4, 8, 16, 32)]
    assert pads == sorted(pads, reverse=True) and pads[0] > pads[-1]
    assert bucketing.fixed_buckets(16384) == [256, 512, 1024, 2048, 4096, 8192, 16384]
    with pytest.raises(ConfigError, match="end at 16384 < the longest sequence 20000"):
        bucketing.fixed_buckets(20000)


GROUPS = [ReplicaGroup(scheme(1, 1, 1024), 3), ReplicaGroup(scheme(2, 1, 2048, k=1.3), 1), ReplicaGroup(scheme(2, 2, 4096, k=1.5), 1)]
BUCKETS = [128, 512, 1024, 2048, 4096]
COUNTS = [40, 20, 9, 5, 2]


def test_balanced_ilp_objective_recomputed_and_counts_conserved():
    d = balanced(GROUPS, BUCKETS, COUNTS)
    assert d.status == "optimal"
    assert [sum(row) for row in d.n] == COUNTS
    for i, s in enumerate(BUCKETS):
        for j, g in enumerate(GROUPS):
            if d.n[i][j]:
                assert g.scheme.mbs(s) * s <= g.scheme.max_tokens
    assert all(sum(d.n[i][j] for i in range(len(BUCKETS))) >= 1 for j in range(len(GROUPS)))
    # the solver's z equals max_j T_j recomputed from the integers (tie-break term aside)
    assert d.objective_s == pytest.approx(d.info["solver_objective_s"], rel=1e-4)
    assert d.objective_s == pytest.approx(max(group_time(g, BUCKETS, [r[j] for r in d.n])
                                              for j, g in enumerate(GROUPS)))
    assert d.objective_s <= length_based(GROUPS, BUCKETS, COUNTS).objective_s + 1e-12


def test_balanced_ilp_optimal_by_brute_force():
    groups = [ReplicaGroup(scheme(1, 1, 512), 2), ReplicaGroup(scheme(2, 2, 1024, k=1.4), 1)]
    buckets, counts = [256, 512, 1024], [7, 4, 2]
    d = balanced(groups, buckets, counts, mip_gap=0.0)
    best = float("inf")
    for a in range(counts[0] + 1):
        for b in range(counts[1] + 1):
            n = [[a, counts[0] - a], [b, counts[1] - b], [0, counts[2]]]
            if sum(r[0] for r in n) < 1 or sum(r[1] for r in n) < 1:
                continue
            best = min(best, max(group_time(g, buckets, [r[j] for r in n]) for j, g in enumerate(groups)))
    assert d.objective_s == pytest.approx(best, rel=1e-9)


def test_time_limit_keeps_incumbent_or_falls_back():
    d = balanced(GROUPS, BUCKETS, COUNTS, time_limit_s=1e-4)
    assert d.status in ("optimal", "time_limit", "fallback_length")
    assert [sum(r) for r in d.n] == COUNTS


def test_split_every_sample_exactly_once_and_micro_batches_fit():
    rng = np.random.default_rng(1)
    samples = [Sample(f"T{k % 3}", k, int(x)) for k, x in enumerate(rng.integers(16, 4000, 60))]
    bs = bucketing.dynamic_buckets([s.length for s in samples], 6)
    sp = plan_step(GROUPS, samples, bs, "balanced")
    seen = [x for j in sp.replicas for r in j for _, mb in r for x in mb]
    assert sorted(seen, key=lambda s: s.seq_id) == samples
    for j, g in enumerate(GROUPS):
        for r in sp.replicas[j]:
            for s, mb in r:
                assert len(mb) * s <= g.scheme.max_tokens and all(x.length <= s for x in mb)
    # fused micro-batches priced per replica: the busiest replica is the dispatch objective
    worst = max(replica_time(g.scheme, [(len(mb), s) for s, mb in r]) for j, g in enumerate(GROUPS)
                for r in sp.replicas[j])
    assert worst == pytest.approx(sp.dispatch.objective_s)


def test_even_split_conserves_and_length_beyond_every_replica_errors():
    d = even([ReplicaGroup(scheme(8, 1, 4096), 3)], BUCKETS, COUNTS)
    assert [sum(r) for r in d.n] == COUNTS
    with pytest.raises(ConfigError, match="bucket length 8192 is beyond every replica's max_tokens"):
        length_based(GROUPS, [8192], [1])


def test_pool_multisets_and_planner():
    schemes = [scheme(1, 1, 1024), scheme(2, 1, 2048, k=1.2), scheme(4, 1, 4096, k=1.5), scheme(2, 2, 4096, k=1.6),
               scheme(4, 1, 2048, k=2.0)]
    pool = scheme_pool(schemes)
    assert {s.max_tokens for s in pool} == {1024, 2048, 4096}
    assert scheme(4, 1, 2048, k=2.0) not in pool or len(pool) > 3
    for c in multisets(pool, 8):
        assert sum(k * s.gpus for k, s in zip(c, pool)) == 8
    buckets, counts = [256, 1024, 2048, 4096], [30, 10, 4, 2]
    p = plan(schemes, 8, buckets, counts, 4000, planner="prune")
    assert sum(g.gpus for g in p.groups) == 8
    assert max(g.scheme.max_tokens for g in p.groups) == 4096
    full = plan(schemes, 8, buckets, counts, 4000, planner="balance")
    grp = plan(schemes, 8, buckets, counts, 4000, planner="group")
    assert full.expected_step_s <= p.expected_step_s * (1 + 0.005) + 1e-12
    assert p.expected_step_s <= grp.expected_step_s + 1e-12
    with pytest.raises(ConfigError, match="workload.num_gpus: 3 GPUs: no combination of schemes sums to it"):
        plan([scheme(2, 1, 2048), scheme(4, 1, 4096)], 3, buckets, counts, 4000)
    with pytest.raises(ConfigError, match="longest sequence 5000 is beyond every replica's max_tokens"):
        plan(schemes, 8, buckets, counts, 5000)
