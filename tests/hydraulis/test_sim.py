"""Hydraulis sim: system knobs, bad input, identical batches, determinism, the presets."""
from __future__ import annotations

import dataclasses
import pathlib

import pytest
from omegaconf import OmegaConf

from impl.common.api import ConfigError
from impl.common.workloads.varlen import VarlenWorkload
from impl.hydraulis.batches import step_batches
from impl.hydraulis.sim import simulate
from impl.hydraulis.system import SIM_POLICIES, Hydraulis

from .conftest import hardware
from impl.common.megatron.derive import step_knobs
from impl.common.conf_files import load_group_file, system_identity


def _wl(name: str, **kw) -> VarlenWorkload:
    d = OmegaConf.load(f"conf/workload/{name}.yaml")
    return dataclasses.replace(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(VarlenWorkload), d)), **kw)


def _system(**kw) -> Hydraulis:
    cfg = Hydraulis.Config(**kw)
    return Hydraulis(cfg, cfg.policy)


def test_batches_are_exactly_g_and_shared_by_every_policy():
    wl = _wl("hydraulis_7b_16gpu_cc", steps=3)
    a, b = step_batches(wl, 0, 3), step_batches(wl, 0, 3)
    for x, y in zip(a, b):
        assert int(x.lengths.sum()) == wl.token_budget and (x.lengths == y.lengths).all()
        assert x.lengths.max() <= wl.context and x.lengths.min() >= 1


def test_g_smaller_than_one_sequence_is_one_line():
    wl = _wl("hydraulis_7b_16gpu_cc", token_budget=8000)
    with pytest.raises(ConfigError) as e:
        step_batches(wl, 0, 1)
    assert str(e.value) == ("workload.token_budget: G = 8000 is smaller than one sequence of up to 16384 tokens "
                            "(workload.lengths.max_len / context)")


def test_bad_knobs_are_one_line():
    for kw, msg in [({"shuffles": 0}, "system.shuffles: must be >= 1"),
                    ({"ilp_scope": "x"}, "system.ilp_scope: unknown 'x'"),
                    ({"opt_layout": [2, 2]}, "system.opt_layout: need [dp, tp, pp]")]:
        with pytest.raises(ConfigError, match=msg.replace("[", r"\[")):
            _system(**kw)


@pytest.fixture(scope="module")
def runs():
    wl, hw = _wl("hydraulis_7b_16gpu_cc", steps=2), hardware("a800-80g")
    return {p: simulate(_system(policy=p), wl, hw, 0) for p in
            ("hydraulis", "hydraulis_homo", "megatron_like", "hotspa_like", "deepspeed_like", "hydraulis_greedy_dynamic")}


def test_records_carry_the_acceptance_metrics(runs):
    for pol, (m, info) in runs.items():
        assert m["step_time_s"].value > 0 and m["tokens_per_s"].value > 0, pol
        assert len(info["winner_per_step"]) == 2
    m, info = runs["hydraulis"]
    assert "plan_time_s" in m and "ilp_limit_fraction" in m and info["ilp_status_counts"]
    assert info["pool"][0].startswith("0: ") and "optimizer_layout" in info["pool"][0]
    assert info["peak_memory_gib"] <= info["memory_limit_gib"]  # invariant (README "Invariants and tests"): memory within the limit on every GPU


def test_hydraulis_never_plans_worse_than_its_homogeneous_candidate(runs):
    """The pool holds the optimizer-layout strategy, so the dynamic choice cannot lose on
    compute to the homo ablation (same batches, same packer)."""
    assert runs["hydraulis"][0]["compute_time_s"].value <= runs["hydraulis_homo"][0]["compute_time_s"].value + 1e-9


def test_sim_is_deterministic_apart_from_planner_wall_time(runs):
    wl, hw = _wl("hydraulis_7b_16gpu_cc", steps=2), hardware("a800-80g")
    m2, info2 = simulate(_system(policy="hydraulis"), wl, hw, 0)
    m1, info1 = runs["hydraulis"]
    wall = {"plan_time_s", "plan_to_step_ratio"}
    assert {k: v.to_dict() for k, v in m1.items() if k not in wall} == {k: v.to_dict() for k, v in m2.items() if k not in wall}
    assert info1["winner_per_step"] == info2["winner_per_step"]


def test_every_policy_has_a_system_config():
    for p in SIM_POLICIES:
        d = system_identity(load_group_file(pathlib.Path(f"conf/system/hydraulis/{p}.yaml"),
                                            root=pathlib.Path("conf/system")), p)
        assert d.policy == p and d._target_ == "impl.hydraulis.system.Hydraulis"
        Hydraulis(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Hydraulis.Config),
                                                      {k: v for k, v in d.items() if k not in ("_target_", "name")})), p)


def test_presets_exist_with_sweeps():
    for s in ("s1", "s2", "s3", "s4", "s5", "s6"):
        d = OmegaConf.load(pathlib.Path("conf/experiment/hydraulis") / f"{s}.yaml")
        assert d.experiment_name == f"hydraulis/{s}" and d.mode == "sim"
        assert "hydraulis/hydraulis" in str(d.hydra.sweeper.params.system).split(",")


def test_sim_strategies_are_the_step_models_time_and_memory(runs):
    """One pricing path (README, same title): every strategy the sim planned with is seq_cost (ms) with the
    cap of the shared step-model memory (ZeRO-1 over the job's 16 GPUs), and every policy pays
    the step model's iteration overhead once a step, on the datasheet profile too."""
    from impl.common.cost.varlen_model import StrategyLayout, MemoryModel, seq_cost

    wl, hw = _wl("hydraulis_7b_16gpu_cc", steps=2), hardware("a800-80g")
    shared = MemoryModel.for_hardware(hw, zero1=True, sequence_parallel=True)
    m, info = runs["hydraulis"]
    assert info["strategies"]
    for label, r in info["strategies"].items():
        tp, pp = (int(x) for x in label.strip("()").split(","))
        sc = seq_cost(wl.model, StrategyLayout(1, tp, pp), hw)
        assert (r["a"], r["b"], r["c"]) == pytest.approx((sc.a * 1e3, sc.b * 1e3, sc.c * 1e3), rel=1e-12), label
        assert r["cap"] == shared.maxlen(wl.model, StrategyLayout(16 // (tp * pp), tp, pp), 16) // 128 * 128, label
    assert info["memory_limit_gib"] == pytest.approx(shared.capacity_bytes / 2**30)
    from impl.common.cost.transformer import model_params
    from impl.common.megatron.step import optimizer_step_s

    # every training system's per-iteration rule: Adam over the optimizer layout's shard + the overhead
    over = optimizer_step_s(float(model_params(wl.model)), wl.num_gpus, hw)
    assert over > step_knobs(hw).iteration_overhead_s > 0
    for pol, (mp, inf) in runs.items():
        assert mp["overhead_time_s"].value == pytest.approx(over) and inf["iteration_overhead_s"] == over, pol


def test_deepspeed_like_prices_ulysses_on_the_step_model(runs):
    from impl.common.cost.varlen_model import StrategyLayout, seq_cost
    from impl.hydraulis.cost.strategy import load_cost_data
    from impl.hydraulis.sim import SimEnv, _ulysses, cost_spec

    wl, hw = _wl("hydraulis_7b_16gpu_cc", steps=2), hardware("a800-80g")
    system = _system(policy="deepspeed_like")
    env = SimEnv(wl, hw, system, cost_spec(system), load_cost_data())
    for sp in (2, 8):
        r1, g1 = _ulysses(env, sp, 1)
        r3, g3 = _ulysses(env, sp, 3)
        sc = seq_cost(wl.model, StrategyLayout(1, sp, 1, "ulysses"), hw)
        assert (r1.a, r1.b, r1.c) == pytest.approx((sc.a * 1e3, sc.b * 1e3, sc.c * 1e3), rel=1e-12)
        assert r1.cap == env.mem.maxlen(sp, 1, "ulysses", 1) // 128 * 128 and g1 == 0.0
        assert r3.cap >= r1.cap and g3 > 0  # ZeRO-3 frees the replicated params and grads, pays gathers
    assert runs["deepspeed_like"][1]["deepspeed_layout"].startswith("zero")


def test_removed_cost_knobs_are_rejected():
    """mfu / causal / c_per_layer_ms are gone (the step model has its own terms): a config that
    still sets one fails at merge time; source auto is an unknown source."""
    from omegaconf.errors import ConfigKeyError

    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(OmegaConf.structured(Hydraulis.Config), {"sim": {"cost": {"mfu": 0.55}}})
    from impl.hydraulis.sim import check_sim

    wl = _wl("hydraulis_7b_16gpu_cc", steps=1)
    s = _system()
    s.cfg.sim.cost.source = "auto"
    with pytest.raises(ConfigError) as e:
        check_sim(s, wl, hardware("a800-80g"))
    assert str(e.value) == "system.sim.cost.source: unknown 'auto' (one of: derived, published)"
