"""The paper's own setups: the kernel a server runs is a knob (S3 reports Punica's and
S-LoRA's), iterations are timed by kind (v1 Fig. 11), and the S2 / S3 / S4 figures put ours
beside the paper's."""
from __future__ import annotations

import pathlib

import pytest

from impl.caraserve.figures import paper_values, s2_vs_paper, s3_vs_paper, s4_vs_paper, slo_vs_scale
from impl.caraserve.sim import build_cost
from impl.caraserve.system import ServingSystem
from impl.common.api import ConfigError
from impl.caraserve.policies import serving
from impl.common.llm.scheduler import SchedulerConfig, kernels_of
from impl.common.workloads.serving import ServingAdapters, ServingTrace, ServingWorkload
from tests.caraserve.test_config import S1
from tests.caraserve.test_paper_settings import job

from bench.app import preflight


def test_lora_kernels_knob_picks_the_kernel_family_for_any_policy():
    assert kernels_of(SchedulerConfig(policy=serving("caraserve"))) == ("sgmv", "bgmv")
    assert kernels_of(SchedulerConfig(policy=serving("caraserve"), lora_kernels="slora")) == ("mbgmv", "mbgmv")
    assert kernels_of(SchedulerConfig(policy=serving("slora"), lora_kernels="punica")) == ("sgmv", "bgmv")
    assert kernels_of(SchedulerConfig(policy=serving("slora"))) == ("mbgmv", "mbgmv")
    with pytest.raises(ConfigError, match=r"^system.lora_kernels: unknown 'cutlass' \(one of: auto, punica, slora\)$"):
        SchedulerConfig(policy=serving("caraserve"), lora_kernels="cutlass")
    error = preflight([*S1, "+system.lora_kernels=cutlass"])
    assert error is not None and error.startswith("system.lora_kernels: unknown 'cutlass'"), error


def test_slora_kernels_change_caraserve_costs_and_the_routers_law(tmp_path):
    """Same trace, 2 servers, rank-aware: with S-LoRA's kernels the fitted law is sum r and the
    decode iterations are priced by MBGMV (slower at mbgmv_efficiency 0.5), and the record says so."""
    wl = ServingWorkload(trace=ServingTrace(num_requests=60, rate_rps=20.0, output_median=12),
                         adapters=ServingAdapters(num_adapters=30), num_servers=2)
    out = {}
    for k in ("auto", "slora"):
        s = ServingSystem(ServingSystem.Config(policy="caraserve", router="rank_aware", plots=False, lora_kernels=k), "c")
        out[k] = s.run(job(tmp_path, wl))
    assert out["auto"].info["lora_kernels"] == ["sgmv", "bgmv"] and out["slora"].info["lora_kernels"] == ["mbgmv", "mbgmv"]
    assert out["auto"].info["cost_model"]["kernel"] == "bgmv" and out["slora"].info["cost_model"]["kernel"] == "mbgmv"
    it = {k: r.info["iteration_mean_s"] for k, r in out.items()}
    assert it["slora"]["decode"] > it["auto"]["decode"] > 0
    assert it["auto"]["prefill"] > 0


def test_iteration_means_are_the_cost_of_each_iteration(tmp_path):
    """One request alone on a CACHED server: its one prefill and its decode steps, as priced."""
    wl = ServingWorkload(trace=ServingTrace(num_requests=1, rate_rps=1.0, output_median=6, sigma=0.01),
                         adapters=ServingAdapters(num_adapters=1, ranks=[16], rank_weights=[1.0]))
    s = ServingSystem(ServingSystem.Config(policy="cached", router="mostidle", plots=False), "cached")
    j = job(tmp_path, wl)
    r = s.run(j)
    req = s.trace(j).requests[0]
    c = build_cost(s, j)
    assert r.info["iteration_mean_s"]["prefill"] == pytest.approx(c.prefill_s([req.prompt_len], [16]))
    steps = [c.decode_s([req.prompt_len + g], [16]) for g in range(1, req.output_len)]
    assert r.info["iteration_mean_s"]["decode"] == pytest.approx(sum(steps) / len(steps))


def rec(system, slo, kernels=("sgmv", "bgmv"), rate=340, ref=0.0236, policy="caraserve", model="llama2-7b", lat=1.0):
    return {"status": "ok", "system": system,
            "metrics": {"slo_attainment": {"value": slo}, "latency_mean_s": {"value": lat}},
            "info": {"lora_kernels": list(kernels), "slo_reference": {"tpot_mean_s": ref, "slo_tpot_s": 1.5 * ref}},
            "config": {"system": {"policy": policy}, "workload": {"trace": {"rate_rps": rate},
                                                                  "paper_model": {"name": model}}}}


def test_paper_figures_beside_ours_write_pngs(tmp_path):
    paper = paper_values()
    assert (paper["s3_slo_mostidle_punica_kernel"], paper["s3_slo_mostidle_slora_kernel"]) == (0.17, 0.27)
    assert (paper["s4_slo_rank_aware"], paper["s2_caraserve_gain_over_ondmd_13b"]) == (0.8, 0.202)
    routers = [rec(n, v, k) for n, v in (("caraserve", 0.9), ("mostidle", 0.3), ("firstfit", 0.0))
               for k in (("sgmv", "bgmv"), ("mbgmv", "mbgmv"))]
    s2 = [rec("x", 0, policy=p, model=m, lat=l) for m in ("llama2-13b", "llama2-70b")
          for p, l in (("cached", 2.0), ("ondmd", 2.6), ("caraserve", 2.1))]
    for f, recs, name in ((s3_vs_paper, routers, "s3_vs_paper.png"), (s4_vs_paper, routers, "s4_vs_paper.png"),
                          (slo_vs_scale, routers, "slo_vs_scale.png"), (s2_vs_paper, s2, "s2_vs_paper.png")):
        paths = f(recs, tmp_path)
        assert [pathlib.Path(p).name for p in paths] == [name]
        assert pathlib.Path(paths[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f([], tmp_path) == []
