"""Checkpoint-recovery sim (impl/ckpt_recovery/README.md, "Sim"): ranking by ETTR over the sim's own output,
S4 idling, the failure model's rate, Young/Daly, determinism, I/O counts from the plan code."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from impl.common.fault_model.spec import GpuLoss, NodeLoss
from impl.ckpt_recovery.sim.scenario import POLICY_MODELS, Scenario, canonical, failure_trace, fault_metrics, poisson_metrics
from impl.ckpt_recovery.sim.config import CkptSimKnobs
from impl.ckpt_recovery.sim.cost import save_cost, young_daly_s
from impl.common.hardware import HardwareProfile, load_hardware
from impl.common.storage.emulator import paper_profile
from impl.common.workloads.hybrid import HybridWorkload

POLICIES = tuple(POLICY_MODELS)


def _hw() -> HardwareProfile:
    return load_hardware("h100-sxm")


def _wl(name: str) -> HybridWorkload:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HybridWorkload), OmegaConf.load(f"conf/workload/{name}.yaml")))


@pytest.fixture(scope="module")
def hw():
    return _hw()


def _scenarios(wl, hw, knobs=None):
    return {p: Scenario(p, wl, hw, knobs or CkptSimKnobs()) for p in POLICIES}


@pytest.fixture(scope="module")
def s1(hw):
    return _scenarios(_wl("ckpt_s1_7b"), hw, dataclasses.replace(CkptSimKnobs(), trials=6))


@pytest.fixture(scope="module")
def s4(hw):
    return _scenarios(_wl("ckpt_s4_70b"), hw)


def _best(results: dict) -> str:
    return max(results, key=lambda p: results[p]["ettr"])


@pytest.mark.parametrize("profile", ["nas5", "network"])
def test_ours_keeps_highest_ettr_s1(s1, profile):
    res = {p: fault_metrics(sc, GpuLoss(ranks=[5]), paper_profile(profile)) for p, sc in s1.items()}
    assert _best(res) == "ckpt_recovery", {p: r["ettr"] for p, r in res.items()}
    # and the reasons are the modelled ones: no stall, tens of reads where DCP issues hundreds
    assert res["ckpt_recovery"]["t_stall_s"] < res["dcp_async"]["t_stall_s"] < res["dcp_sync"]["t_stall_s"]
    assert res["ckpt_recovery"]["read_calls"] < 100 < res["dcp_sync"]["read_calls"]


def test_s4_node_granular_idle_until_repair(s4):
    repair = 3600.0 * sum(CkptSimKnobs().repair_h) / 2
    res = {p: fault_metrics(sc, GpuLoss(ranks=[28, 29, 30, 31]), paper_profile("nas5")) for p, sc in s4.items()}
    for p in ("restart_all", "gemini_like"):
        assert res[p]["t_idle_s"] == repair and res[p]["throughput_kept"] == 0.0 and res[p]["gpus_used"] == 0.0
        assert res[p]["t_lost_s"] > repair
    ours = res["ckpt_recovery"]
    assert ours["gpus_used"] == 28 and ours["t_idle_s"] == 0.0 and 0.5 < ours["throughput_kept"] < 1.0
    assert _best(res) == "ckpt_recovery", {p: r["ettr"] for p, r in res.items()}


def test_heterogeneous_plan_uses_the_partial_node(s4):
    p = s4["ckpt_recovery"].plan_after((28, 29, 30, 31))
    sizes = sorted(g.size for g in p.groups)
    assert sizes == [4, 8, 8, 8] and set(p.suspended) == {28, 29, 30, 31}


def test_failure_model_reproduces_lambda():
    k = dataclasses.replace(CkptSimKnobs(), days=7.0 * 60, repair_h=[1e-6, 1e-6])
    N, gpn = 1024, 8
    ev = failure_trace(N, gpn, k, seed=3)
    gpu_hours = N * k.days * 24
    expected = k.failure_rate_per_gpu_h * gpu_hours
    assert abs(len(ev) - expected) < 3 * math.sqrt(expected), (len(ev), expected)
    single = sum(1 for e in ev if e.node is None)
    p = k.single_gpu_frac
    assert abs(single - p * len(ev)) < 3 * math.sqrt(len(ev) * p * (1 - p))
    assert all(len(e.gpus) == gpn for e in ev if e.node is not None)
    assert all(2.0 * 3600 <= e.repair_s <= 6.0 * 3600 for e in failure_trace(N, gpn, CkptSimKnobs(), seed=1))


def test_young_daly():
    C, M = 30.0, 5.0e6
    assert young_daly_s(C, M) == pytest.approx(math.sqrt(2 * C * M))
    s = save_cost("sync", staging_s=5.0, write_s=24.0, commit_s=1.0, step_s=2.0, mtbf_s=M, min_interval_s=20.0)
    assert s.stall_s == 30.0 and s.lag_s == 0.0 and s.interval_s == pytest.approx(math.sqrt(2 * C * M))

    def waste(i):  # stall share + expected rework share, the quantity I* minimises to first order
        return C / i + i / (2 * M)
    assert waste(s.interval_s) < min(waste(0.9 * s.interval_s), waste(1.1 * s.interval_s))
    # an async save whose own stall is ~0 is bounded by its commit lag (skip-not-wait)
    a = save_cost("overlapped", staging_s=0.5, write_s=40.0, commit_s=0.1, step_s=2.0, mtbf_s=M, min_interval_s=20.0)
    assert a.stall_s == 0.0 and a.interval_s == pytest.approx(40.6) and a.rework_s() == pytest.approx(40.6 / 2 + 40.6)
    assert a.rework_s(mid_save=True) == pytest.approx(40.6 + 40.6 / 2)


def test_deterministic_records(hw):
    from impl.ckpt_recovery.sim.scenario import run_sim
    from impl.ckpt_recovery.system import CkptRecovery
    from impl.common.api import JobContext

    def run(seed, policy="ckpt_recovery", failures="fault", fault=GpuLoss(ranks=[5])):
        knobs = dataclasses.replace(CkptSimKnobs(), failures=failures, trials=4, storage_profiles=["nas5"])
        sysm = CkptRecovery(CkptRecovery.Config(policy=policy, sim=knobs), policy)
        job = JobContext(mode="sim", seed=seed, experiment="t", workload=_wl("ckpt_s1_7b"), workload_name="w",
                         hardware=hw, hardware_name="h100", fault=fault, fault_name="f", out_dir=None)
        return {k: v.to_dict() for k, v in run_sim(sysm, job).metrics.items()}
    assert run(0) == run(0)
    from impl.common.fault_model.spec import NoFault
    assert run(7, "dcp_async", "poisson", NoFault()) == run(7, "dcp_async", "poisson", NoFault())
    k = CkptSimKnobs()
    assert failure_trace(1024, 8, k, 7) == failure_trace(1024, 8, k, 7) != failure_trace(1024, 8, k, 8)


def test_poisson_ranking_small(s1):
    res = {p: poisson_metrics(sc, paper_profile("nas5"), seed=2) for p, sc in s1.items()}
    means = {p: float(np.mean(r["ettr_samples"])) for p, r in res.items()}
    assert max(means, key=means.get) == "ckpt_recovery", means
    assert res["ckpt_recovery"]["failures_per_trial"] == res["dcp_sync"]["failures_per_trial"]  # same traces


def test_io_counts_come_from_the_plan_code(s1):
    sc = s1["ckpt_recovery"]
    io, base = sc.io, sc.base
    assert io.state_bytes == pytest.approx(14 * 6.74e9, rel=0.01)
    assert sum(io.save_dcp(base).rank_bytes.values()) == pytest.approx(io.state_bytes)
    # A node lost: the re-plan deepens the pipeline (TP4 PP2 -> TP1 PP3), so a reader's layers
    # straddle old stage files: the legacy loader reads whole files, ours and DCP what they need.
    new = sc.plan_after(tuple(range(8)))
    assert new.pipelines[0].num_stages != base.pipelines[0].num_stages
    ours, dcp, legacy = io.load_ours(base, new), io.load_dcp(base, new), io.load_legacy(base, new)
    assert ours.read_ratio() == pytest.approx(1.0, abs=0.01) and dcp.read_ratio() == pytest.approx(1.0, abs=0.01)
    assert legacy.read_ratio() > 1.9 and io.load_legacy(base, base).read_ratio() == pytest.approx(1.0, abs=0.01)
    assert ours.max_calls() < dcp.max_calls() / 5
    # same layout: the manifest, its own file's header and one merged run (the whole file), plus
    # on TP ranks > 0 the header of TP rank 0's file and one run per dtype of the replicated
    # norms it wrote (whole tensors lead each dtype's section)
    same = io.load_ours(base, base)
    assert sorted({r.calls for r, _ in same.readers}) == [3, 6]


def test_canonical_lost_set():
    assert canonical([3], 32, 8) == (31,)
    assert canonical([0, 1, 2, 3, 4, 5, 6, 7, 9], 32, 8) == (23, 24, 25, 26, 27, 28, 29, 30, 31)
    assert canonical([], 32, 8) == ()


def test_node_loss_scenario(hw):
    wl = _wl("ckpt_s1_7b")
    knobs = dataclasses.replace(CkptSimKnobs(), storage_profiles=["nas5"])
    ours = fault_metrics(Scenario("ckpt_recovery", wl, hw, knobs), NodeLoss(node=1), paper_profile("nas5"))
    assert ours["gpus_used"] <= 24 and ours["throughput_kept"] > 0.5
