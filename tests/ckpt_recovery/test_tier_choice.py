"""``sim.tier_choice: auto`` (README "Peer memory"): per storage profile the peer system runs the tier set
with the highest ETTR predicted over the failure model's mix (never the scenario's fault), and
then prices exactly that tier, as a fixed run of it would; peer copies that do not fit are left
out with the host-memory line instead of failing the job."""
from __future__ import annotations

import dataclasses

import pytest

from impl.common.fault_model.spec import GpuLoss, NodeLoss
from impl.ckpt_recovery.sim.scenario import Scenario, check_sim, fault_metrics, predicted_ettr, run_sim, tier_candidates
from impl.ckpt_recovery.sim.config import CkptSimKnobs
from impl.ckpt_recovery.system import CkptRecovery
from impl.common.api import ConfigError, JobContext
from impl.common.storage.emulator import paper_profile

from .test_sim_local import _hw, _wl

PROFILES = ["nas5", "network"]  # the slowest and the fastest storage


def _job(wl, fault):
    return JobContext(mode="sim", seed=0, experiment="t", workload=_wl(wl), workload_name="w", hardware=_hw(),
                      hardware_name="h100", fault=fault, fault_name="f", out_dir=None)


def _run(wl, fault, **kw):
    knobs = dataclasses.replace(CkptSimKnobs(), storage_profiles=PROFILES, **kw)
    sysm = CkptRecovery(CkptRecovery.Config(policy="ckpt_recovery", sim=knobs), "ckpt_recovery")
    return run_sim(sysm, _job(wl, fault))


def test_auto_runs_the_tier_it_predicts_best_and_prices_it_like_a_fixed_run():
    # failures 10x rarer than Llama 3's: nas5 still runs the peer tier, network storage alone
    # on the paper's layout (on the fastest DP16 base the peer tier loses to local copies)
    wl, fault, rare = "ckpt_s1_7b", GpuLoss(ranks=[5]), dict(failure_rate_per_gpu_h=2.0e-6, base_layout="nominal")
    auto = _run(wl, fault, peer_copies=1, tier_choice="auto", **rare)
    tiers = auto.info["tier_choice"]
    knobs = dataclasses.replace(CkptSimKnobs(), peer_copies=1, storage_profiles=PROFILES, **rare)
    cands, refused = tier_candidates("ckpt_recovery", _wl(wl), _hw(), knobs)
    assert [label for label, _ in cands] == ["storage only", "local copies k=1", "peer copies k=1"] and not refused
    assert len({id(c._plans) for _, c in cands}) == 1  # one re-plan per lost set for every candidate
    chosen = set()
    for prof in PROFILES:
        pred = {label: predicted_ettr(sc, paper_profile(prof)) for label, sc in cands}
        assert tiers[prof]["predicted_ettr"] == pred
        assert tiers[prof]["chosen"] == max(pred, key=pred.get)
        fixed = fault_metrics(dict(cands)[tiers[prof]["chosen"]], fault, paper_profile(prof))
        assert auto.metrics[f"ettr@{prof}"].value == fixed["ettr"]
        assert auto.metrics[f"t_lost_s@{prof}"].value == fixed["t_lost_s"]
        chosen.add(tiers[prof]["chosen"])
    assert chosen == {"peer copies k=1", "storage only"}  # both branches taken
    # info describes the headline profile's tier (nas5: the peer tier), not the last one priced
    assert auto.info["storage"] == "nas5" and tiers["nas5"]["chosen"] == "peer copies k=1"
    assert auto.info["peer_copies"] == 1


def test_peer_copies_that_do_not_fit_are_left_out_with_the_host_memory_line():
    # fixed peer copies that do not fit are refused; auto runs another tier and says why
    tight = dict(peer_copies=1, host_mem_bytes_per_node=0.9e12)  # S1 needs 989 GB per node
    with pytest.raises(ConfigError, match=r"^system\.sim\.host_mem_bytes_per_node: peer copies do not fit"):
        _run("ckpt_s1_7b", GpuLoss(ranks=[5]), **tight)
    auto = _run("ckpt_s1_7b", GpuLoss(ranks=[5]), tier_choice="auto", **tight)
    for prof in PROFILES:
        t = auto.info["tier_choice"][prof]
        assert t["chosen"] in ("storage only", "local copies k=1") and set(t["predicted_ettr"]) == {
            "storage only", "local copies k=1"}
        assert t["refused"]["peer copies k=1"].startswith("system.sim.host_mem_bytes_per_node: peer copies do not fit")
    assert "peer_copies" not in auto.info


def test_prediction_is_the_fault_formula_over_the_failure_mix():
    knobs = dataclasses.replace(CkptSimKnobs(), peer_copies=1, peer_correlated_frac=0.25)
    sc = Scenario("ckpt_recovery", _wl("ckpt_s1_7b"), _hw(), knobs)
    prof = paper_profile("nas5")
    last = sc.num_nodes - 1
    # the S1-S4 ETTR of a one-GPU loss (canonical: the last GPU) and of the last node's loss
    # (with its correlated share), whatever the job's fault
    one = fault_metrics(sc, GpuLoss(ranks=[sc.wl.num_gpus - 1]), prof)["ettr"]
    node = fault_metrics(sc, NodeLoss(node=last), prof)["ettr"]
    assert one != node
    for frac, want in ((1.0, one), (0.0, node)):
        sc.k = dataclasses.replace(knobs, single_gpu_frac=frac)
        assert predicted_ettr(sc, prof) == want
    # ETTR is linear in the expected loss: the mix is the weighted mean of the two
    p = 0.587
    sc.k = dataclasses.replace(knobs, single_gpu_frac=p)
    assert predicted_ettr(sc, prof) == pytest.approx(p * one + (1 - p) * node, rel=1e-12)


def test_bad_tier_choice_is_one_line():
    wl = _wl("ckpt_s1_7b")
    for policy, kw, pat in (("ckpt_recovery", {"tier_choice": "best"}, "unknown 'best'"),
                            ("dcp_async", {"tier_choice": "auto", "peer_copies": 0}, "auto needs policy ckpt_recovery"),
                            ("ckpt_recovery", {"tier_choice": "auto", "peer_copies": 0}, "peer_copies >= 1")):
        sysm = CkptRecovery(CkptRecovery.Config(policy=policy, sim=dataclasses.replace(CkptSimKnobs(), **kw)), policy)
        with pytest.raises(ConfigError, match=rf"^system\.sim\.tier_choice: .*{pat}"):
            check_sim(sysm, wl, _hw(), GpuLoss(ranks=[5]))
