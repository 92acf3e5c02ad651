"""Plan validity, the worked examples of the authors' planner tests (`examples/malleus/test_strategy_model.py`;
exact), monotonicity and determinism."""
from __future__ import annotations

import pytest

from impl.common.api import ConfigError
from impl.common.parallel.cost import StageMemoryRows
from impl.common.parallel.plan import (Group, Plan, PipelinePlan, PlanError, format_plan, group_rates, plan_diff,
                                       plan_violations, plan_z, uniform_plan, validate_plan, z_lower_bound)
from impl.common.parallel.ilp import ilp_a, ilp_b, ilp_b_exact
from impl.common.parallel.planner import PlannerConfig, PlannerError, check_feasible, check_uniform_fits, plan
from impl.common.parallel.tp_groups import node_groups

MEM_32B = StageMemoryRows(2850, 500, 1000, 5000, 81252, 4)
MEM_70B = StageMemoryRows(1231, 416, 500, 4500, 81252, 4)
CFG1 = PlannerConfig(num_gpus=32, gpus_per_node=8, dp=4, tp=2, pp=4, num_layers=60, num_microbatches=64,
                     alpha=(1.0, 2.0, 4.0, 8.0), memory=MEM_32B)
CFG2 = PlannerConfig(num_gpus=64, gpus_per_node=8, dp=2, tp=8, pp=4, num_layers=80, num_microbatches=64,
                     alpha=(1.0, 1.90, 3.66, 7.22), memory=MEM_70B)


def rates(n, slow):
    x = [1.0] * n
    for g, v in slow.items():
        x[g] = v
    return x


X1 = rates(32, {0: 4.79, 8: 2.34, 16: 3.8})
X2 = rates(64, {0: 12.53, 8: 12.53, 16: 2.57})


@pytest.fixture(scope="module")
def ex1():
    return plan(CFG1, X1)


@pytest.fixture(scope="module")
def ex2():
    return plan(CFG2, X2)


def test_worked_example_1_exact(ex1):
    p = ex1.plan
    assert [list(pp.layers) for pp in p.pipelines] == [[11, 8, 19, 22], [5, 17, 19, 19], [15] * 4, [15] * 4]
    assert [pp.micro_batches for pp in p.pipelines] == [11, 15, 19, 19]
    assert ex1.z == pytest.approx(285)
    # straggler groups y = 2.34, 2.0 (shrunk: the 4.79 GPU suspended), 3.8
    ys = sorted(y for y in ex1.group_y if y > 1)
    assert ys == pytest.approx([2.0, 2.34, 3.8])
    assert p.suspended == (0,)
    # straggler-free Z = 240; uniform 3.8*15*16 = 912 -> 3.2x
    assert plan_z(CFG1.uniform(), group_rates(CFG1.uniform(), [1.0] * 32, CFG1.alpha)) == 240
    assert 912 / ex1.z == pytest.approx(3.2, abs=0.01)


def test_worked_example_2_exact(ex2):
    p = ex2.plan
    assert [list(pp.layers) for pp in p.pipelines] == [[2, 5, 5, 10, 10, 10, 19, 19], [3, 3, 6, 23, 22, 23]]
    assert [pp.micro_batches for pp in p.pipelines] == [35, 29]
    assert ex2.z == pytest.approx(667)
    assert sorted(g.size for g in p.groups) == [1] * 3 + [2] * 3 + [4] * 3 + [8] * 5
    assert set(p.suspended) == {0, 8, 16}


@pytest.mark.parametrize("res_name", ["ex1", "ex2"])
def test_planner_output_valid(res_name, request):
    res = request.getfixturevalue(res_name)
    cfg, x = (CFG1, X1) if res_name == "ex1" else (CFG2, X2)
    validate_plan(res.plan, memory=cfg.memory, x=x, alpha=cfg.alpha, z=res.z)
    assert res.z >= z_lower_bound(res.plan, res.group_y) - 1e-9
    assert Plan.from_dict(res.plan.to_dict()) == res.plan
    assert "Z = " in format_plan(res.plan, res.group_y)
    assert plan_diff(cfg.uniform(), res.plan)


def test_all_healthy_gives_uniform():
    res = plan(CFG1, [1.0] * 32)
    assert res.z == 60 * 64 / 16
    assert all(pp.layers == (15,) * 4 and pp.micro_batches == 16 for pp in res.plan.pipelines)
    assert res.plan.suspended == ()


def test_deterministic():
    a, b = plan(CFG1, X1), plan(CFG1, X1)
    assert a.plan.to_json() == b.plan.to_json() and a.z == b.z


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_ilp_a_monotone_in_y(solver):
    """Fixed template: Z never decreases when any group rate grows."""
    base = [3.0, 1.0, 1.0, 1.0]
    prev = None
    for y0 in [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0]:
        zs = []
        for ys in ([y0, 1.0, 1.0, 1.0], base):
            zs.append(ilp_a(ys, [1.0] * 4, 60, MEM_32B, solver)[0])
        Z = ilp_b(zs, [4, 4], 64)[0]
        assert Z == ilp_b_exact(zs, [4, 4], 64)
        if prev is not None:
            assert Z >= prev - 1e-9
        prev = Z


def test_planner_z_monotone_when_a_rate_grows():
    prev = 0.0
    for v in [1.0, 1.3, 2.0, 3.0, 4.79, 8.0]:
        z = plan(CFG1, rates(32, {0: v, 8: 2.34})).z
        assert z >= prev - 1e-9
        prev = z


def test_validator_catches_broken_plans():
    u = uniform_plan(8, 4, 2, 2, 2, 8, 8)
    assert plan_violations(u) == []
    bad_m = Plan(u.num_gpus, u.gpus_per_node, u.tp, u.num_layers, u.num_microbatches, u.groups,
                 (PipelinePlan(u.pipelines[0].groups, (4, 4), 1), u.pipelines[1]), ())
    v = " ".join(plan_violations(bad_m))
    assert "m=1 < 2 stages" in v and "sum to 5" in v
    bad_l = Plan(u.num_gpus, u.gpus_per_node, u.tp, u.num_layers, u.num_microbatches, u.groups,
                 (PipelinePlan(u.pipelines[0].groups, (3, 4), 4), u.pipelines[1]), ())
    assert "sum to 7, not L=8" in " ".join(plan_violations(bad_l))
    cross = Plan(8, 4, 2, 8, 8, (Group((3, 4), 0),) + u.groups[1:], u.pipelines, ())
    v = " ".join(plan_violations(cross))
    assert "spans nodes" in v
    odd = Plan(8, 4, 4, 8, 8, (Group((0, 1, 2), 0), Group((4, 5, 6, 7), 1)),
               (PipelinePlan((0, 1), (4, 4), 8),), (3,))
    assert "tp/2^k" in " ".join(plan_violations(odd))
    with pytest.raises(PlanError):
        validate_plan(bad_m)


def test_memory_violation_reported():
    p = uniform_plan(32, 8, 4, 2, 4, 60, 64)
    tiny = StageMemoryRows(2850, 500, 1000, 5000, 40000, 4)
    assert any("MB > capacity" in v for v in plan_violations(p, memory=tiny))


def test_bad_input_one_line():
    with pytest.raises(ConfigError, match="dp\\*tp\\*pp"):
        PlannerConfig(num_gpus=32, gpus_per_node=8, dp=4, tp=2, pp=2, num_layers=60, num_microbatches=64)


def test_two_stragglers_in_a_tp2_node_get_a_plan():
    """As many stragglers as the TP degree in one node: the planner regroups (no refusal)."""
    x = rates(32, {8: 2.0, 9: 2.0})
    res = plan(CFG1, x)
    validate_plan(res.plan, memory=CFG1.memory, x=x, alpha=CFG1.alpha, z=res.z)
    assert res.z < plan_z(CFG1.uniform(), group_rates(CFG1.uniform(), x, CFG1.alpha))
    x3 = rates(32, {8: 3.0, 9: 5.0, 10: 2.5})  # three in a node at tp=2
    validate_plan(plan(CFG1, x3).plan, memory=CFG1.memory)


def test_no_plan_names_the_failed_constraint():
    """A tp=4 straggler node splits into 4+2+1 groups: 3 stages need 3 micro-batches, M is 2."""
    cfg = PlannerConfig(num_gpus=8, gpus_per_node=8, dp=1, tp=4, pp=2, num_layers=8, num_microbatches=2)
    with pytest.raises(PlannerError) as e:
        plan(cfg, rates(8, {6: 8.0, 7: 8.0}))
    msg = str(e.value)
    assert "\n" not in msg
    assert "3 TP groups need >= 3 micro-batches" in msg and "num_microbatches is 2" in msg and "node 0: 4+2+1" in msg
    with pytest.raises(PlannerError, match="3 TP groups need >= 3 micro-batches"):
        check_feasible(cfg, rates(8, {6: 8.0, 7: 8.0}))  # the preflight meets the same error
    assert issubclass(PlannerError, ConfigError)


def test_no_plan_fits_memory_names_the_capacity():
    """Uniform fits, but a regrouped layout does not: the error gives the layers that fit."""
    mem = StageMemoryRows(2850, 500, 1000, 5000, 22000, 4)
    cfg = PlannerConfig(num_gpus=8, gpus_per_node=8, dp=1, tp=4, pp=2, num_layers=8, num_microbatches=8, memory=mem)
    check_uniform_fits(cfg.uniform(), cfg)
    with pytest.raises(PlannerError, match=r"workload.memory: no layout fits device memory: with 3 TP groups "
                                           r"\(node 0: 4\+2\+1\) the roomiest pipeline tried \(3 stages\) holds at most "
                                           r"6 of 8 layers at capacity 22000 MB per GPU"):
        plan(cfg, rates(8, {7: 3.5}))


def _tp4_node(penalty):
    return node_groups(range(8), 0, rates(8, {7: 3.5}), 4, (1.0, 2.0, 4.0), penalty)


def test_shrink_penalty_per_level_changes_the_choice():
    """One straggler (3.5x) in a tp=4 node: keep it in a full group (score 1/3.5) or shrink to
    2+1 and suspend it (1/(2 w_1) + 1/(4 w_2)). Level 1 is the same in both lists; level 2's
    penalty decides."""
    groups, susp = _tp4_node((1.0, 2.0, 2.0))
    assert [g.gpus for g in groups] == [(0, 1, 2, 3), (4, 5), (6,)] and susp == [7]
    groups, susp = _tp4_node((1.0, 2.0, 8.0))
    assert [g.gpus for g in groups] == [(0, 1, 2, 3), (4, 5, 6, 7)] and susp == []
    # through the whole planner
    base = dict(num_gpus=8, gpus_per_node=8, dp=1, tp=4, pp=2, num_layers=8, num_microbatches=8)
    x = rates(8, {7: 3.5})
    assert plan(PlannerConfig(**base, shrink_penalty=(1.0, 2.0, 2.0)), x).plan.suspended == (7,)
    assert plan(PlannerConfig(**base, shrink_penalty=(1.0, 2.0, 8.0)), x).plan.suspended == ()


def test_shrink_penalty_default_is_the_old_scalar_at_every_level():
    """The old knob was one w = 2.0 for every shrunk group (w_0 = 1): the default list is
    that, so the worked examples above (tp=8: levels 1-3) and the sim figures are unchanged."""
    from impl.malleus.system import HybridTraining

    old = (1.0, 2.0, 2.0, 2.0)
    assert PlannerConfig(**dict(num_gpus=8, gpus_per_node=8, dp=1, tp=8, pp=1, num_layers=8,
                                num_microbatches=8)).shrink_penalty == old
    assert tuple(HybridTraining.Config().shrink_penalty) == old
    for tp in (2, 4, 8):
        x = rates(8, {7: 3.0, 6: 1.5})
        assert _old_scalar_groups(x, tp, 2.0) == node_groups(range(8), 0, x, tp, (1.0, 2.0, 4.0, 8.0), old)


def _old_scalar_groups(x, tp, w):
    """Step 1 with the old scalar weight, by brute force over the same candidate splits."""
    import math

    from impl.common.parallel.plan import effective_rate
    from impl.common.parallel.tp_groups import TPGroup

    ids = list(range(8))
    healthy = [g for g in ids if effective_rate(x[g]) == 1.0]
    order = healthy + sorted((g for g in ids if effective_rate(x[g]) > 1.0), key=lambda g: (x[g], g))
    per_node = 8 // tp
    best, best_key = None, None
    for n_full in range(per_node - 1, -1, -1):
        for h0 in [tp >> i for i in range(int(math.log2(tp)) + 1)]:
            cand = [TPGroup(tuple(order[i * tp:(i + 1) * tp]), 0, 0,
                            effective_rate(max(x[g] for g in order[i * tp:(i + 1) * tp]))) for i in range(n_full)]
            window, pos, size, k = order[n_full * tp:(n_full + 1) * tp], 0, h0, int(round(math.log2(tp // h0)))
            while size >= 1 and pos + size <= len(window):
                sub = window[pos:pos + size]
                cand.append(TPGroup(tuple(sub), 0, k, effective_rate((1.0, 2.0, 4.0, 8.0)[k] * max(x[g] for g in sub))))
                pos, size, k = pos + size, size // 2, k + 1
            key = round(math.fsum(1.0 / (g.y * (1.0 if g.k == 0 else w)) for g in cand), 12)
            if best_key is None or key > best_key:
                used = {g for grp in cand for g in grp.gpus}
                best, best_key = (cand, sorted(set(ids) - used)), key
    return best


def test_shrink_penalty_needs_a_level_per_tp_shrink():
    with pytest.raises(ConfigError, match=r"^shrink_penalty: tp=8 needs 4 entries \(k = 0..3\), got \[1.0, 2.0\]$"):
        PlannerConfig(num_gpus=8, gpus_per_node=8, dp=1, tp=8, pp=1, num_layers=8, num_microbatches=8,
                      shrink_penalty=(1.0, 2.0))
    with pytest.raises(ConfigError, match="level 0 .* must be 1.0"):
        PlannerConfig(num_gpus=8, gpus_per_node=8, dp=1, tp=2, pp=4, num_layers=8, num_microbatches=8,
                      shrink_penalty=(2.0, 2.0))


def test_unavailable_gpus_join_no_group():
    """Checkpoint recovery's use: 7 of a tp=4 node's 8 GPUs alive give 4 + 2 + 1 (impl/ckpt_recovery/recovery/replan.py);
    the lost GPU is listed as suspended (it holds nothing)."""
    cfg = PlannerConfig(num_gpus=8, gpus_per_node=8, dp=1, tp=4, pp=2, num_layers=8, num_microbatches=8,
                        shrink_penalty=(1.0, 1.0, 1.0))
    res = plan(cfg, [1.0] * 8, unavailable=[3])
    assert sorted(g.size for g in res.plan.groups) == [1, 2, 4] and res.plan.suspended == (3,)
    assert all(3 not in g.gpus for g in res.plan.groups)
