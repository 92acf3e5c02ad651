"""HotSPa sim: invariants (sim side: impl/hotspa/README.md), switch-planner policies, presets, bad input."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np
import pytest
from omegaconf import OmegaConf

from impl.common.api import ConfigError
from impl.common.hardware import HardwareProfile, load_hardware
from impl.common.parallel.migration import POLICIES, held_units, plan_migration
from impl.common.varlen.packing import assign_dp, check_packing, group_by_boundaries, hotspa_pack
from impl.common.varlen.sampling import LengthStream
from impl.common.workloads.varlen import VarlenWorkload
from impl.hotspa.planner import plan_groups
from impl.hotspa.presets import load_presets
from impl.hotspa.cost import GRAD_BYTES, PARAM_BYTES, PricingEnv, price_grouped_step
from impl.hotspa.sim import at_context, simulate
from impl.hotspa.sim_config import HotSPaSimKnobs
from impl.hotspa.strategy import GroupPlan, Strategy, make_group_plan
from impl.hotspa.system import HotSPa


def _hw(name: str = "a800-80g") -> HardwareProfile:
    return load_hardware(name)


def _wl(name: str) -> VarlenWorkload:
    d = OmegaConf.load(f"conf/workload/{name}.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(VarlenWorkload), d))


def _system(**kw) -> HotSPa:
    cfg = HotSPa.Config(**kw)
    return HotSPa(cfg, cfg.policy)


def test_presets_load_and_drop_top_boundaries():
    p = load_presets()
    assert p.boundaries("c1", 32768) == [32768, 16384, 4096, 0]
    assert p.boundaries("c1", 16384) == [16384, 4096, 0]
    assert p.boundaries("c2", 8192) == [8192, 4096, 0]
    assert p.boundaries("c2", 4096) == [4096, 0]
    gp = p.group_plan("c1", "llama2-7b", 8, 16384)  # the authors' 16K preset: (2,2,2) + (8,1,1)
    assert gp.strategies == (Strategy(2, 2, 2), Strategy(8, 1, 1))
    assert p.group_plan("c2", "llama-32b", 32, 32768).home == Strategy(1, 16, 2)


def test_a100_preset_groups_and_strategies():
    """The A100 preset (our reading of `examples/hotspa`): {<=2K, 2-4K, 4-8K} at 8K; the 3B
    strategies of the artifact's A100 script under c1 ({<=4K (8,1,1), 4-8K/4-16K (2,2,2), 16-32K (1,4,2)})."""
    p = load_presets()
    assert p.boundaries("a100", 8192) == [8192, 4096, 2048, 0]
    assert p.boundaries("a100", 4096) == [4096, 2048, 0]
    gp = p.group_plan("a100", "llama-3b", 8, 8192)
    assert gp.strategies == (Strategy(2, 2, 2), Strategy(4, 2, 1), Strategy(8, 1, 1)) and gp.home == Strategy(2, 2, 2)
    assert p.group_plan("a100", "llama-3b", 8, 4096).strategies == (Strategy(4, 2, 1), Strategy(8, 1, 1))
    assert p.group_plan("c1", "llama-3b", 8, 8192).strategies == (Strategy(2, 2, 2), Strategy(8, 1, 1))
    assert p.group_plan("c1", "llama-3b", 8, 16384).strategies == (Strategy(2, 2, 2), Strategy(8, 1, 1))
    assert p.group_plan("c1", "llama-3b", 8, 32768).strategies == (Strategy(1, 4, 2), Strategy(2, 2, 2),
                                                                   Strategy(8, 1, 1))
    with pytest.raises(ConfigError, match=r"workload.context: 16384 is above preset a100's top boundary 8192"):
        p.group_plan("a100", "llama-3b", 8, 16384)
    # the sim runs the preset: each sequence in the group its length names, one strategy per group
    wl = dataclasses.replace(_wl("hotspa_3b_8gpu_cc"), steps=1)
    m, info = simulate(_system(grouping="a100"), wl, _hw("a100-40g"), 0)
    assert info["boundaries"] == [8192, 4096, 2048, 0] and info["strategies"] == ["(2,2,2)", "(4,2,1)", "(8,1,1)"]
    assert len(info["group_micro_batches_step0"]) == 3 and m["switch_time_s"].value > 0


def test_bad_preset_file_is_one_line(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("groupings: {c1: [32768, 16384, 4096, 0]}\nstrategies:\n"
                 "  - {model: m, num_gpus: 8, ranges: {'0-4096': [2, 2, 1]}}\n")
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp = 2\*2\*1 = 4 != workload.num_gpus 8") as e:
        load_presets(f)
    assert "\n" not in str(e.value)


def test_bad_input_one_liners():
    with pytest.raises(ConfigError, match=r"strictly descending.*\[4096, 8192, 0\]"):
        make_group_plan([4096, 8192, 0], [[8, 1, 1], [8, 1, 1]], 8)
    with pytest.raises(ConfigError, match=r"strategies\[1\]: dp\*tp\*pp = 4\*1\*1 = 4 != workload.num_gpus 8"):
        make_group_plan([8192, 4096, 0], [[4, 2, 1], [4, 1, 1]], 8)
    wl = at_context(_wl("hotspa_7b_8gpu_cc"), 262144)
    env = PricingEnv(wl, _hw(), HotSPaSimKnobs())
    batch = LengthStream(wl.lengths, 0).by_count(8)
    with pytest.raises(ConfigError, match=r"workload.context: a sequence of 262144 tokens is longer than every "
                                          r"strategy's maxlen \(the largest \d+ at"):
        plan_groups(env, [batch], wl.context, candidates=[4096], max_groups=2, max_tp=8, pad="align", align=128,
                    policy="bandwidth_greedy")
    # A group whose strategy does not fit its bound (memory model) is refused by name.
    sys_ = _system(grouping="explicit", boundaries=[32768, 4096, 0], strategies=[[8, 1, 1], [8, 1, 1]])
    with pytest.raises(ConfigError, match=r"system.strategies\[0\]: \(8,1,1\) fits micro-batches of at most \d+ "
                                          r"tokens .* below its group bound 32768"):
        sys_.check("sim", _wl("hotspa_7b_8gpu_cc"), _hw(), type("F", (), {"kind": "none"})())


def test_grouping_packing_and_dp_invariants():
    wl = _wl("hotspa_13b_16gpu_gh")
    gp = load_presets().group_plan("c2", wl.model.name, wl.num_gpus, wl.context)
    batch = LengthStream(wl.lengths, 3).by_count(wl.global_batch_seqs)
    groups = group_by_boundaries(batch.ids, batch.lengths, gp.boundaries)
    seen = []
    for g, s in zip(groups, gp.strategies):
        mbs = hotspa_pack(g.seq_ids, g.lengths, bound=g.upper, align=128)
        check_packing(g.seq_ids, g.lengths, mbs)  # each sequence once, no bound exceeded
        ranks = assign_dp(mbs, s.dp)
        assert len({len(r) for r in ranks}) <= 1  # leftovers padded with empty micro-batches
        assert sum(not mb.is_empty for r in ranks for mb in r) == len(mbs)  # nothing dropped
        seen += [sid for r in ranks for mb in r for sid in mb.seq_ids]
    assert sorted(seen) == sorted(int(i) for i in batch.ids)


def test_empty_group_contributes_nothing():
    wl = _wl("hotspa_7b_8gpu_cc")
    env = PricingEnv(wl, _hw(), HotSPaSimKnobs())
    gp = load_presets().group_plan("c1", wl.model.name, wl.num_gpus, wl.context)
    ids, lens = np.arange(6), np.array([100, 200, 300, 1000, 2000, 3000])  # all in the <=4K group
    p = price_grouped_step(env, ids, lens, gp, pad="align", align=128, policy="bandwidth_greedy")
    assert p.group_compute_s[0] == 0.0 and p.group_compute_s[1] == 0.0 and p.group_compute_s[2] > 0
    assert p.group_micro_batches[:2] == [0, 0]
    assert p.order == [str(gp.strategies[2]), str(gp.home)]  # short group, then home for the update
    solo = price_grouped_step(env, ids, lens, GroupPlan(gp.boundaries, gp.strategies), pad="align", align=128,
                              policy="bandwidth_greedy")
    assert solo.step_s == p.step_s


@pytest.mark.parametrize("policy", POLICIES)
def test_switch_plan_covers_every_needer_slice_once_from_an_owner(policy):
    wl = _wl("hotspa_32b_32gpu_cc")
    env = PricingEnv(wl, _hw(), HotSPaSimKnobs())
    src, dst = Strategy(4, 2, 4), Strategy(1, 16, 2)
    trs = env.transfers(src, dst, policy)
    have, need = held_units(env.plan(src)), held_units(env.plan(dst))
    got: dict = {}
    for t in trs:
        lo, hi = have[t.src][t.unit]
        assert lo <= t.lo and t.hi <= hi  # the sender owns the slice
        assert t.src != t.dst and (t.src // 8 != t.dst // 8) == t.inter_node
        got.setdefault((t.dst, t.unit), []).append((t.lo, t.hi))
    for dev, units in need.items():
        for u, (lo, hi) in units.items():
            own = have.get(dev, {}).get(u)
            pieces = sorted(got.get((dev, u), []))
            if own:  # reused locally: only the part it does not hold arrives
                pieces = sorted(pieces + [(max(lo, own[0]), min(hi, own[1]))] if own[0] < hi and lo < own[1] else pieces)
            covered = Fraction(0)
            cur = lo
            for a, b in pieces:
                assert a == cur, f"GPU {dev} unit {u}: gap or overlap at {cur}"
                cur = b
                covered += b - a
            assert cur == hi


def test_default_policy_is_unchanged_greedy():
    wl = _wl("hotspa_13b_16gpu_cc")
    env = PricingEnv(wl, _hw(), HotSPaSimKnobs())
    a, b = env.plan(Strategy(8, 2, 1)), env.plan(Strategy(2, 8, 1))
    assert plan_migration(a, b, env.unit_params) == plan_migration(a, b, env.unit_params, "bandwidth_greedy")


@pytest.mark.parametrize("name,grouping", [("hotspa_32b_32gpu_cc", "c1"), ("hotspa_32b_32gpu_cc", "c2"),
                                           ("hotspa_13b_16gpu_gh", "c2"), ("hotspa_7b_16gpu_gh", "c1")])
def test_switch_time_orders_greedy_rr_fcfs_on_preset_switches(name, grouping):
    wl = _wl(name)
    env = PricingEnv(wl, _hw(), HotSPaSimKnobs())
    gp = load_presets().group_plan(grouping, wl.model.name, wl.num_gpus, wl.context)
    layouts = [gp.home, *reversed(gp.strategies[1:]), gp.home]
    for x, y in zip(layouts, layouts[1:]):
        t = {p: env.switch_s(x, y, PARAM_BYTES + GRAD_BYTES, p, True) for p in POLICIES}
        assert t["bandwidth_greedy"] <= t["round_robin"] * (1 + 1e-12) <= t["fcfs"] * (1 + 1e-12), (x, y, t)


def test_memory_within_capacity_for_every_preset_strategy_and_switch():
    p = load_presets()
    names = {"llama2-7b": "7b", "llama2-13b": "13b", "llama-32b": "32b", "llama-3b": "3b"}
    for (model, n), table in p.strategies.items():
        hw = _hw("a100-40g" if model == "llama-3b" else "a800-80g")  # 3B: the artifact's A100-40G check
        env = PricingEnv(_wl(f"hotspa_{names[model]}_{n}gpu_cc"), hw, HotSPaSimKnobs())
        for (lo, hi), s in table.items():
            assert env.memory_bytes(s, hi) <= env.mem.capacity_bytes, (model, n, s, hi)
        for x in table.values():
            for y in table.values():  # a real switch: two different layouts coexist
                assert x == y or env.switch_peak_bytes(x, y) <= env.mem.capacity_bytes, (model, n, x, y)


def test_sim_is_deterministic_and_reports_strategies():
    wl = dataclasses.replace(_wl("hotspa_13b_8gpu_gh"), steps=2)
    s = _system(grouping="c2", sim=HotSPaSimKnobs(report_policies=["fcfs"]))
    m1, i1 = simulate(s, wl, _hw(), 7)
    m2, i2 = simulate(s, wl, _hw(), 7)
    assert {k: v.value for k, v in m1.items()} == {k: v.value for k, v in m2.items()}
    assert i1 == i2
    assert i1["strategies"] == ["(1,8,1)", "(1,4,2)", "(2,2,2)", "(4,2,1)"]
    assert m1["switch_time_s"].value > 0 and m1["switch_time_s@fcfs"].value >= m1["switch_time_s"].value
    m3, _ = simulate(s, wl, _hw(), 8)
    assert m3["step_time_s"].value != m1["step_time_s"].value  # the seed matters


def test_single_group_has_no_switch_and_equals_same_engine_static():
    wl = dataclasses.replace(at_context(_wl("hotspa_7b_16gpu_cc"), 4096), steps=2)
    a, _ = simulate(_system(policy="hotspa"), wl, _hw(), 0)
    b, _ = simulate(_system(policy="hotspa_static"), wl, _hw(), 0)
    assert a["switch_time_s"].value == 0.0 and a["step_time_s"].value == b["step_time_s"].value


def test_megatron_static_strategy_fits_the_context():
    # 16K: at 32K no tp <= 8 layout of 32B on 32 A800s holds the context on the step model's memory
    # (best (1,8,4): 30,418 tokens; the authors' home strategy is the cross-node (1,16,2)).
    wl = dataclasses.replace(at_context(_wl("hotspa_32b_32gpu_cc"), 16384), steps=1)
    m, info = simulate(_system(policy="megatron_static"), wl, _hw(), 0)
    assert info["maxlen"][0] >= wl.context and m["step_time_s"].value > 0
    s = Strategy(*(int(x) for x in info["strategies"][0].strip("()").split(",")))
    assert s.tp <= 8 and wl.model.num_layers % s.pp == 0 and s.gpus == 32


def test_ablation_knobs_replicas_and_buffer_fusion():
    """Our ablations as priced: replicas drop the parameter switches but refresh every
    replica after the update and keep the other strategies' bf16 params resident; unfused
    switches pay one latency per slice, so they are never cheaper than fused ones."""
    wl = dataclasses.replace(_wl("hotspa_32b_32gpu_cc"), steps=1)
    arms = {(r, f): simulate(_system(grouping="c2", sim=HotSPaSimKnobs(replicas=r, buffer_fusion=f)), wl, _hw(), 0)[0]
            for r in (False, True) for f in (True, False)}
    for r in (False, True):
        assert arms[(r, False)]["switch_time_s"].value >= arms[(r, True)]["switch_time_s"].value
        assert arms[(r, False)]["compute_time_s"].value == arms[(r, True)]["compute_time_s"].value
    assert arms[(True, True)]["peak_memory_gib"].value > arms[(False, True)]["peak_memory_gib"].value
    assert arms[(True, True)]["switch_time_s"].value != arms[(False, True)]["switch_time_s"].value
    # one group (4K): no other strategy, so no replica, no switch: every arm prices the same
    one = {(r, f): simulate(_system(sim=HotSPaSimKnobs(replicas=r, buffer_fusion=f)), at_context(wl, 4096), _hw(), 0)[0]
           for r in (False, True) for f in (True, False)}
    assert len({(m["step_time_s"].value, m["peak_memory_gib"].value) for m in one.values()}) == 1


def test_ablation_figure_reads_each_records_own_knobs(tmp_path):
    from impl.hotspa.figures import ablation, ablation_table

    def rec(replicas, fusion, step):
        return {"system": "hotspa", "workload": "hotspa_7b_8gpu_gh", "status": "ok", "mode": "sim",
                "config": {"system": {"sim": {"replicas": replicas, "buffer_fusion": fusion}}},
                "info": {"context": 32768, "memory_capacity_gib": 76.0},
                "metrics": {"step_time_s": {"value": step}, "switch_time_s": {"value": step / 100},
                            "peak_memory_gib": {"value": 60.0}, "step_time_s@ctx16384": {"value": step / 2}}}

    recs = [rec(False, True, 10.0), rec(True, True, 11.0), rec(False, False, 12.0)]
    t = ablation_table(recs)
    assert t[("7b_8gpu_gh", "hotspa", 32768)][(True, True)]["step_time_s"] == 11.0
    assert t[("7b_8gpu_gh", "hotspa", 16384)][(False, False)]["step_time_s"] == 6.0
    assert (True, False) not in t[("7b_8gpu_gh", "hotspa", 32768)]
    assert ablation(recs, tmp_path)[0].exists()


def test_sequence_parallel_off_keeps_norms_and_residuals_whole_per_tp_rank():
    from impl.common.cost.varlen_model import StrategyLayout, MemoryModel

    wl, hw = _wl("hotspa_32b_32gpu_cc"), _hw()
    sp = MemoryModel.for_hardware(hw, headroom_bytes=4 * 2**30)
    no = dataclasses.replace(sp, sequence_parallel=False)
    m = wl.model
    assert no.per_token_bytes(m, StrategyLayout(16, 1, 2)) == pytest.approx(sp.per_token_bytes(m, StrategyLayout(16, 1, 2)))
    extra = [no.per_token_bytes(m, StrategyLayout(32 // (tp * 2), tp, 2)) - sp.per_token_bytes(m, StrategyLayout(32 // (tp * 2), tp, 2))
             for tp in (2, 8)]
    assert 0 < extra[0] < extra[1]  # what SP would split stays whole: more of it the larger tp
    assert no.maxlen(m, StrategyLayout(1, 16, 2), 32) < sp.maxlen(m, StrategyLayout(1, 16, 2), 32)
    # the static baseline without SP: no tp <= 16 strategy holds a 32K context for 32B on 32 GPUs
    sim = _system(policy="megatron_static", sim=HotSPaSimKnobs(sequence_parallel=False, static_max_tp=16))
    with pytest.raises(ConfigError, match=r"workload.context: 32768 tokens is longer than every tp strategy's maxlen"):
        simulate(sim, wl, hw, seed=0)


def test_planner_holds_the_longest_group_with_tp_across_nodes_as_the_authors():
    """32B on 64 A800s at 32K (hydraulis/s1's hotspa_planned): no strategy of tp <= 8 holds 32K
    under the step model's allocatable bytes; the planner takes TP across nodes for that group only,
    as the paper's 32B home (1,16,2) does, instead of failing."""
    wl = _wl("hydraulis_32b_64gpu_cc")
    # On the preset's Hetu kernels (megatron_llama_fused) (2,8,4) holds 34,706 tokens and the case
    # does not arise; on the fork's plain kernels no tp <= 8 strategy holds 32K (at most 23,987).
    wl = dataclasses.replace(wl, model=dataclasses.replace(wl.model, megatron_stack="megatron_llama_fork"))
    env = PricingEnv(wl, _hw("a800-80g-megatron"), HotSPaSimKnobs(memory_headroom_bytes=None))
    narrow = [s for s in (Strategy(64 // (8 * pp), 8, pp) for pp in (1, 2, 4, 8)) if env.maxlen(s) > 0]
    assert narrow and max(env.maxlen(s) for s in narrow) < wl.context
    batch = LengthStream(wl.lengths, 0).by_count(64)
    gp = plan_groups(env, [batch], wl.context, candidates=[8192], max_groups=2, max_tp=8, pad="align",
                     align=128, policy="bandwidth_greedy").plan
    assert gp.boundaries[0] == wl.context and env.maxlen(gp.home) >= wl.context and gp.home.tp > 8
    assert all(s.tp <= 8 for s, hi in zip(gp.strategies, gp.boundaries) if hi < wl.context)
