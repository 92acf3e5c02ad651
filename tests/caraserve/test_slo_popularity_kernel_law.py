"""The paper's SLO (1.5x the base model's per-token latency under the same load), the
MAF popularity stand-in, the Toppings kernel-latency law on our kernels, and CaraServe never
priced below CACHED."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.app import preflight
from impl.caraserve.figures import s3_testbed_vs_paper
from impl.caraserve.kernel_law import fit_kernel_law, fit_sim_law, law_feature, law_grid
from impl.caraserve.sim import base_reference, build_cost, simulate_policy
from impl.caraserve.system import ServingSystem
from impl.common.api import ConfigError
from impl.common.llm.serving_engine import EngineRequest, ServingEngine
from impl.caraserve.policies import serving
from impl.common.llm.scheduler import SchedulerConfig
from impl.common.traces import TraceSpec, generate_trace, lognormal_weights, maf_popularity, top_share
from impl.common.workloads.serving import ServingAdapters, ServingTrace, ServingWorkload
from tests.caraserve.test_config import S1
from tests.caraserve.test_paper_settings import job


def system(policy="caraserve", router="mostidle", **kw):
    return ServingSystem(ServingSystem.Config(policy=policy, router=router, plots=False, **kw), policy)


# ---- the SLO reference run -----------------------------------------------------------------
def test_sim_slo_reference_run_has_no_lora_work_and_sets_the_slo(tmp_path):
    wl = ServingWorkload(trace=ServingTrace(num_requests=120, rate_rps=12.0, output_median=20),
                         adapters=ServingAdapters(num_adapters=40, ranks=[64], rank_weights=[1.0]), num_servers=2)
    j = job(tmp_path, wl)
    s = system("caraserve", "rank_aware")
    trace, cost = s.trace(j), build_cost(s, j)
    ref = base_reference(s, j, trace, cost)
    assert ref["kind"] == "base" and ref["requests"] == 120 and ref["servers"] == 2
    assert ref["engine"] == {"loads": 0, "cpu_layers": 0, "lora_rows": 0}  # the engine's own counters
    assert ref["slo_tpot_s"] == pytest.approx(1.5 * ref["tpot_mean_s"])
    # the same engine with LoRA on does LoRA work, and its per-token latency is higher
    res, _ = simulate_policy(s, j, trace, cost, "caraserve", "mostidle")
    assert res.lora_rows > 0 and res.loads > 0
    tpot = np.mean([r.tpot_s for r in res.records if r.output_len > 1])
    assert tpot > ref["tpot_mean_s"]
    # the job's record carries the reference beside the attainment, every request under its SLO
    out = s.run(j)
    assert out.info["slo_reference"]["kind"] == "base" and out.info["slo_reference"]["engine"]["lora_rows"] == 0
    assert out.info["slo_reference"]["slo_tpot_s"] == pytest.approx(ref["slo_tpot_s"])
    assert "slo_attainment" in out.metrics


def test_isolated_slo_is_a_named_option_not_the_default(tmp_path):
    assert ServingWorkload().slo_reference == "base" and ServingWorkload().slo_scale == 1.5
    wl = ServingWorkload(trace=ServingTrace(num_requests=40, rate_rps=5.0, output_median=10),
                         adapters=ServingAdapters(num_adapters=10), slo_reference="isolated", slo_scale=2.0)
    out = system().run(job(tmp_path, wl))
    assert out.info["slo_reference"] == {"kind": "isolated", "slo_scale": 2.0}


def test_real_slo_reference_run_has_no_lora_work(tiny):
    base, ads = tiny
    reqs = [EngineRequest(rid=i, arrival_s=0.0, adapter=a, prompt=[5 + i, 9, 11, 13], output_len=4)
            for i, a in enumerate(["a16", "a64", "a32", "a16"])]
    counts = {}
    for lora in (False, True):
        eng = ServingEngine(base, ads, SchedulerConfig(policy=serving("caraserve"), max_batch=4, pool_slots=2, load_groups=2),
                            lora=lora)
        try:
            st = eng.serve(reqs)
        finally:
            eng.close()
        assert len(st.records) == 4
        counts[lora] = (st.lora_rows, st.loads, st.cpu_jobs, st.cpu_layers)
    assert counts[False] == (0, 0, 0, 0)
    assert counts[True][0] > 0 and counts[True][1] > 0


# ---- the MAF popularity stand-in -----------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_stand_in_puts_99_6_percent_on_the_top_18_6_percent_of_40k_adapters(seed):
    w = lognormal_weights(40000, 3.54, np.random.default_rng(seed))
    assert top_share(w, 0.186) == pytest.approx(0.996, abs=0.005)
    # grouped at random, one group per server (60): each group an equal share of the requests
    p, group = maf_popularity(40000, 3.54, 60, np.random.default_rng(seed))
    assert np.bincount(group).min() == np.bincount(group).max() == 40000 // 60 or np.ptp(np.bincount(group)) == 1
    assert np.bincount(group, weights=p) == pytest.approx(np.full(60, 1 / 60))
    assert p.sum() == pytest.approx(1.0)


def test_stand_in_trace_is_seeded_and_skewed():
    spec = TraceSpec(num_requests=3000, num_adapters=512, popularity="lognormal", lognormal_sigma=3.54,
                     ranks=[64], rank_weights=[1.0])
    a, b = generate_trace(spec, 3), generate_trace(spec, 3)
    assert [r.adapter for r in a.requests] == [r.adapter for r in b.requests]
    assert [r.adapter for r in a.requests] != [r.adapter for r in generate_trace(spec, 4).requests]
    counts = np.bincount([int(r.adapter.split("-")[1]) for r in a.requests], minlength=512)
    zipf = generate_trace(dataclasses.replace(spec, popularity="zipf", zipf_alpha=1.0), 3)
    zc = np.bincount([int(r.adapter.split("-")[1]) for r in zipf.requests], minlength=512)
    assert (counts > 0).sum() < (zc > 0).sum()  # far fewer distinct adapters than Zipf 1.0


def test_the_record_says_which_popularity(tmp_path):
    wl = ServingWorkload(trace=ServingTrace(num_requests=40, rate_rps=5.0, output_median=10),
                         adapters=ServingAdapters(num_adapters=100, popularity="lognormal"), num_servers=2)
    out = system().run(job(tmp_path, wl))
    assert out.info["popularity"] == {"kind": "lognormal", "stand_in_for": "MAF (Azure Functions 2019), impl/caraserve/README.md [R]",
                                      "sigma": 3.54, "groups": 2}


@pytest.mark.parametrize("overrides, expected", [
    (["+workload.adapters.popularity=maf"], "workload.adapters.popularity: unknown 'maf' (one of: zipf, lognormal)"),
    (["+workload.adapters.popularity=lognormal", "+workload.adapters.lognormal_sigma=0"],
     "workload.adapters.lognormal_sigma must be a finite number > 0, got 0.0"),
    (["+workload.adapters.popularity=lognormal", "+workload.adapters.popularity_groups=-1"],
     "workload.adapters.popularity_groups must be >= 0"),
    (["+workload.adapters.popularity=lognormal", "+workload.adapters.popularity_groups=100000"],
     "workload.adapters.popularity_groups: 100000 groups for"),
    (["workload.adapters.zipf_alpha=-1"], "workload.adapters.zipf_alpha must be a finite number >= 0, got -1.0"),
    (["+workload.slo_reference=single"], "workload.slo_reference: unknown 'single' (one of: base, isolated, hf_peft)"),
])
def test_bad_popularity_and_slo_options_fail_at_preflight_in_one_line(overrides, expected):
    error = preflight([*S1, *overrides])
    assert error is not None and error.startswith(expected) and "\n" not in error, error


# ---- the kernel-latency law ------------------------------------------------------------------
def test_kernel_law_fits_our_sim_kernels_and_the_router_uses_it(tmp_path):
    wl = ServingWorkload(trace=ServingTrace(num_requests=60, rate_rps=20.0, output_median=12),
                         adapters=ServingAdapters(num_adapters=30), num_servers=2)
    j = job(tmp_path, wl)
    for kern, fam in (("punica", "bgmv"), ("slora", "mbgmv")):
        s = system("caraserve", "rank_aware", lora_kernels=kern)
        law = fit_sim_law(build_cost(s, j), fam)
        assert law.kernel == fam and law.r2 > 0.999 and law.alpha_s > 0
        out = s.run(j)
        cm = out.info["cost_model"]
        assert cm["kernel_law"]["kernel"] == fam and cm["kernel_law"]["r2"] == pytest.approx(law.r2)
        assert cm["decode_coef"][2] == pytest.approx(law.alpha_s)  # the router's rank term is the law's alpha
        assert cm["decode_r2"] >= 0.9
    # the law tells the kernels apart on the mixed batches of its grid
    mixes = law_grid(0)
    pad = [law_feature(m, "bgmv") * 1e-6 + 1e-4 for m in mixes]
    assert fit_kernel_law(mixes, pad, "bgmv", "t").r2 == pytest.approx(1.0)
    assert fit_kernel_law(mixes, pad, "mbgmv", "t").r2 < 0.95
    with pytest.raises(ConfigError, match=r"^kernel law: need >= 3 timed rank mixes"):
        fit_kernel_law(mixes[:2], pad[:2], "bgmv", "t")


def test_testbed_figure_writes_a_png(tmp_path):
    recs = [{"status": "ok", "system": n, "metrics": {"slo_attainment": {"value": v}, "tpot_mean_s": {"value": 0.03}},
             "config": {"workload": {"trace": {"rate_rps": rate}}}}
            for n, v in (("caraserve", 0.9), ("mostidle", 0.5)) for rate in (30, 40, 50)]
    paths = s3_testbed_vs_paper(recs, tmp_path)
    assert [p.name for p in paths] == ["s3_testbed_vs_paper.png"] and paths[0].read_bytes()[:4] == b"\x89PNG"
    assert s3_testbed_vs_paper([], tmp_path) == []
