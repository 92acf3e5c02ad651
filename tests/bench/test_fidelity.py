"""Fidelity: records carry sim/real per headline metric; sim records' provenance names their
family's latest fidelity (null when never measured on this host). No timing is asserted."""
from __future__ import annotations

import json
import sys

import pytest
import yaml

from bench.fidelity import store
from bench.fidelity.families import family_of
from bench.fidelity.view import fidelity_rows, format_rows
from bench.gate import inprocess_runner
from bench.record import load_records


def _run(overrides, results):
    rc, last = inprocess_runner([sys.executable, "-m", "bench", *overrides, f"results_dir={results}",
                                 "progress=false"], results)
    assert rc == 0, last
    return load_records(results)[-1]


def _fixture_profile(tmp_path):
    prof = yaml.safe_load(open("conf/hardware/cpu-2core.yaml"))
    prof.update(name="fixture", measured=True, source="test fixture", mfu=1.0, comm_efficiency=1.0)
    path = tmp_path / "fixture.yaml"
    path.write_text(yaml.safe_dump(prof))
    return path


SIM_PIPELINE = ["system=adaptra/zb", "mode=sim", "workload=pipeline_s4", "workload.num_microbatches=4",
                "workload.iterations=2", "workload.warmup_iterations=0", "system.timeline=false"]


def test_sim_record_provenance_names_family_fidelity_null_then_measured(tmp_path):
    results = tmp_path / "runs"
    rec = _run(SIM_PIPELINE, results)
    fid = rec["provenance"]["fidelity"]
    assert fid["family"] == "pipeline" and fid["latest"] is None
    # a fidelity job of this family on this host lands in the store: the next sim record names it
    store.update(store.store_path(None, results), "pipeline", "zb",
                 {"run_id": "r1", "date": "2026-01-02T00:00:00+00:00",
                  "rows": [{"metric": "iteration_time_s", "real": 1.0, "sim": 0.88, "sim_over_real": 0.88,
                            "error_pct": -12.0}]})
    store.update(store.store_path(None, results), "pipeline", "adaptra",
                 {"run_id": "r2", "date": "2026-01-03T00:00:00+00:00",
                  "rows": [{"metric": "iteration_time_s", "real": 1.0, "sim": 1.04, "sim_over_real": 1.04,
                            "error_pct": 4.0}]})
    latest = _run(SIM_PIPELINE, results)["provenance"]["fidelity"]["latest"]
    assert latest["max_abs_error_pct"] == 12.0 and latest["mean_abs_error_pct"] == 8.0
    assert latest["date"].startswith("2026-01-03") and latest["situations"] == 2 and latest["host"]
    # one situation on two workloads (e.g. two mask ratios) keeps both: the worse one stays visible
    for wl, err in (("fisedit_cpu_wide[mask_ratio=0.1]", 25.0), ("fisedit_cpu_wide[mask_ratio=0.35]", 7.0)):
        store.update(store.store_path(None, results), "diffusion", store.situation_key("fisedit", wl, "none"),
                     {"run_id": wl, "date": "2026-01-04T00:00:00+00:00",
                      "rows": [{"metric": "sparse_step_speedup", "real": 1.0, "sim": 1 + err / 100,
                                "sim_over_real": 1 + err / 100, "error_pct": err}]})
    diff = store.family_fidelity(store.store_path(None, results), "diffusion")
    assert diff["situations"] == 2 and diff["max_abs_error_pct"] == 25.0
    # another host's measurement is not this machine's
    assert store.family_fidelity(store.store_path(None, results), "pipeline", host="elsewhere") is None
    assert family_of("diffusion_edit") == "diffusion" and family_of("varlen") == "varlen"


def test_real_records_carry_no_family_fidelity(tmp_path):
    rec = _run(["system=harness/calibrate", "mode=real", f"system.output={tmp_path / 'hw.yaml'}",
                "system.p2p_sizes_bytes=[8,1024]", "system.allreduce_sizes_bytes=[8]", "system.repeats=3",
                "system.matmul_sizes=[64]", "system.mem_bw_bytes=1048576", "system.max_seconds_per_measurement=0.05",
                "validity.max_foreign_cpu_frac=null"], tmp_path / "runs")
    assert "fidelity" not in rec["provenance"]


def test_wrong_family_for_the_workload_is_one_line(tmp_path):
    rc, last = inprocess_runner([sys.executable, "-m", "bench", "system=harness/fidelity", "mode=real",
                                 "workload=pipeline_s4", "system.family=serving",
                                 f"results_dir={tmp_path}"], tmp_path)
    assert rc == 1 and "system.family: 'serving' does not price workload kind 'pipeline'" in last


@pytest.mark.real
def test_fidelity_job_records_sim_over_real_and_updates_the_store(tmp_path):
    results = tmp_path / "runs"
    rec = _run(["experiment=fidelity/pipeline", "system.real_system=zb", "fault.delay_s=0.02",
                f"system.sim_hardware={_fixture_profile(tmp_path)}", "workload.stages=2",
                "workload.num_microbatches=3", "workload.op_pad_s=0.005", "workload.iterations=3",
                "workload.warmup_iterations=0", "validity.max_foreign_cpu_frac=null"], results)
    assert rec["status"] == "ok", rec["invalid_reasons"]
    m = rec["metrics"]
    real, sim = m["real__iteration_time_s"]["value"], m["sim__iteration_time_s"]["value"]
    assert m["sim_over_real__iteration_time_s"]["value"] == pytest.approx(sim / real)
    assert m["error_pct__iteration_time_s"]["value"] == pytest.approx(100 * (sim / real - 1))
    fid = rec["info"]["fidelity"]
    assert (fid["family"], fid["situation"], fid["sim_hardware"]) == ("pipeline", "zb", str(tmp_path / "fixture.yaml"))
    assert "sim_op_time_s" in fid["from_real_run"] and fid["real_target"] == "impl.adaptra.system.PipelineTraining"
    saved = json.loads((results / "fidelity.json").read_text())
    [host] = saved["hosts"]
    key = store.situation_key("zb", rec["workload"], rec["fault"])
    assert saved["hosts"][host]["pipeline"][key]["run_id"] == rec["run_id"]
    rows = fidelity_rows(load_records(results))
    assert [(r["family"], r["metric"]) for r in rows] == [("pipeline", "iteration_time_s")]
    assert "error %" in format_rows(rows)


# ---- the gaps closed: each model change, without a real run ------------------------------------

def _hw(**kw):
    from impl.common.hardware import HardwareProfile

    base = dict(name="t", peak_flops={"fp32": 100e9, "fp16": 400e9}, memory_bw_bytes_per_s=20e9,
                host_link_bw_bytes_per_s=10e9, mfu=1.0)
    return HardwareProfile(**{**base, **kw})


def test_serving_cost_prices_the_models_own_dtype():
    from impl.common.api import ConfigError
    from impl.common.servesim.cost import ServingCost
    from impl.common.workloads.serving import PaperModel

    assert ServingCost.from_profile(PaperModel(), _hw()).flops_per_s == 400e9  # fp16: every paper figure
    assert ServingCost.from_profile(PaperModel(dtype_bytes=4), _hw()).flops_per_s == 100e9
    with pytest.raises(ConfigError, match=r"^workload.paper_model.dtype_bytes: 3 has no serving dtype"):
        ServingCost.from_profile(PaperModel(dtype_bytes=3), _hw())


def test_profiled_load_table_prices_loads_and_roofline_ignores_it():
    from impl.common.servesim.cost import ServingCost, ServingCostConfig
    from impl.common.workloads.serving import PaperModel

    pm = PaperModel(num_layers=4, hidden=512, heads=8, kv_heads=8, ffn_hidden=1376, vocab=1024, dtype_bytes=4)
    cfg = ServingCostConfig(load_table_ranks=[16, 8], load_table_times_s=[0.02, 0.01])
    c = ServingCost.from_profile(pm, _hw(), cfg)
    assert c.load_model_used == "measured:profiled"
    assert (c.load_s(8), c.load_s(16), c.load_s(32)) == pytest.approx((0.01, 0.02, 0.04))
    roof = ServingCost.from_profile(pm, _hw(), ServingCostConfig(load_model="roofline", load_table_ranks=[8, 16],
                                                                  load_table_times_s=[0.01, 0.02]))
    assert roof.load_model_used == "roofline" and roof.load_s(8) < 0.01


def test_serving_profile_takes_the_real_model_loads_and_decode_overhead():
    from bench.fidelity.families import _serving
    from impl.common.api import RunResult
    from impl.common.workloads.serving import LlamaShape, ServingWorkload

    wl = ServingWorkload(model=LlamaShape(hidden=512, ffn_hidden=1376, heads=8, kv_heads=8))
    real = RunResult(metrics={}, info={"emulated_load_s_by_rank": {"8": 0.01, "16": 0.02}, "isolated_tpot_s": 0.006,
                           "isolated_prompt_len": 128, "isolated_rank": 8, "pool_slots": 4})
    prof = _serving(real, wl, _hw())
    assert prof.system["sim_pool_slots"] == 4  # the real engine's pool, not the paper-scale default
    assert prof.workload["paper_model"]["hidden"] == 512 and prof.workload["paper_model"]["dtype_bytes"] == 4
    cost = prof.system["cost"]
    assert (cost["load_table_ranks"], cost["load_table_times_s"]) == ([8, 16], [0.01, 0.02])
    assert 0 < cost["iteration_overhead_s"] < 0.006  # the decode step less its roofline


def test_serving_profile_prices_prefill_at_the_isolated_prefill_rate():
    import dataclasses

    from bench.fidelity.families import _serving
    from impl.common.api import RunResult
    from impl.common.servesim.cost import ServingCost, ServingCostConfig
    from impl.common.workloads.serving import LlamaShape, PaperModel, ServingWorkload

    wl = ServingWorkload(model=LlamaShape(hidden=512, ffn_hidden=1376, heads=8, kv_heads=8))
    info = {"isolated_tpot_s": 0.006, "isolated_prompt_len": 128, "isolated_rank": 8, "isolated_prefill_s": 0.05}
    prof = _serving(RunResult(metrics={}, info=info), wl, _hw())
    cost = prof.system["cost"]
    shape = {k: v for k, v in prof.workload["paper_model"].items()}
    c = ServingCost.from_profile(PaperModel(**shape), _hw(), ServingCostConfig(
        load_model="roofline", iteration_overhead_s=cost["iteration_overhead_s"],
        prefill_flops_per_s=cost["prefill_flops_per_s"]))
    # The profiled rate reproduces the measurement it came from, and only prefill moves.
    assert c.prefill_s([128], [8]) == pytest.approx(0.05)
    plain = dataclasses.replace(c, prefill_flops_per_s=0.0)
    assert c.decode_s([129], [8]) == plain.decode_s([129], [8])
    assert c.prefill_s([256], [8]) > plain.prefill_s([256], [8])  # slower than the calibrated rate here
    # No isolated prefill (or one under the per-iteration overhead): no rate, the roofline stays.
    for t in (None, 0.001):
        p2 = _serving(RunResult(metrics={}, info={**info, "isolated_prefill_s": t}), wl, _hw())
        assert "prefill_flops_per_s" not in p2.system["cost"]


def test_conv_rate_prices_k3_convs_only_and_is_optional():
    from impl.common.diffusion.cost import UNetOp, op_time_s

    k3 = UNetOp("c", "conv", 64, 2e9, 0, 0, 0, kernel=3)
    k1 = UNetOp("p", "conv", 64, 2e9, 0, 0, 0, kernel=1)
    hw = _hw().with_diffusion(conv_flops={"fp32": 200e9})
    assert op_time_s(k3, hw, "fp32", launch_s=0) == pytest.approx(0.01)
    assert op_time_s(k1, hw, "fp32", launch_s=0) == pytest.approx(0.02)  # a 1x1 conv is a matmul
    assert op_time_s(k3, _hw(), "fp32", launch_s=0) == pytest.approx(0.02)  # datasheet profile: unchanged


def test_stagewise_bubble_equals_spec_for_equal_stages_and_hides_an_early_straggler():
    from impl.common.parallel.cost import HybridCostModel, iteration_cost
    from impl.common.parallel.plan import uniform_plan
    from impl.common.workloads.hybrid import HybridWorkload

    wl = HybridWorkload(dtype="fp32", dp=1, pp=2, tp=1, num_gpus=2, gpus_per_node=2, global_batch_size=8, micro_batch_size=1,
                        sim_layer_time_s=0.03)
    # a measured host (its own links, no step-model tables to carry): the layer time is the profile above
    hw = _hw(intra_node_bw_bytes_per_s=1e12, inter_node_bw_bytes_per_s=1e12, measured=True)
    plan = uniform_plan(2, 2, 1, 1, 2, wl.model.num_layers, wl.num_microbatches)
    spec = HybridCostModel.build(wl, hw)
    stw = HybridCostModel.build(HybridWorkload(**{**vars(wl), "pipeline_bubble": "stagewise"}), hw)
    assert iteration_cost(plan, [1, 1], stw).iteration_time_s == pytest.approx(iteration_cost(plan, [1, 1], spec).iteration_time_s)
    layers = wl.model.num_layers // 2
    slow, fast = 3 * layers * 0.03, layers * 0.03
    p2p = iteration_cost(plan, [1, 1], spec).iteration_time_s - 9 * fast
    assert iteration_cost(plan, [3, 1], spec).iteration_time_s == pytest.approx(9 * slow + p2p)
    assert iteration_cost(plan, [3, 1], stw).iteration_time_s == pytest.approx(8 * slow + p2p)
    assert iteration_cost(plan, [1, 3], stw).iteration_time_s == pytest.approx(8 * slow + fast + p2p)


def test_local_thread_profile_must_match_the_runs_threads(tmp_path):
    rc, last = inprocess_runner([sys.executable, "-m", "bench", "experiment=fidelity/diffusion",
                                 "workload.torch_threads=2", f"results_dir={tmp_path}"], tmp_path)
    assert rc == 1 and "system.sim_hardware: local-t1 is calibrated with 1 thread(s) but workload.torch_threads is 2" in last


def _serving_cost(**knobs):
    from impl.common.servesim.cost import ServingCost, ServingCostConfig
    from impl.common.workloads.serving import PaperModel

    shape = dict(name="t", num_layers=4, hidden=512, heads=8, kv_heads=8, ffn_hidden=1376, vocab=1024, dtype_bytes=4)
    return ServingCost.from_profile(PaperModel(**shape), _hw(), ServingCostConfig(load_model="roofline", **knobs))


def test_per_row_overhead_at_zero_leaves_cost_unchanged_and_prices_c0_plus_c1_B():
    plain = _serving_cost(iteration_overhead_s=0.0)
    zero = _serving_cost(iteration_overhead_s=0.0, iteration_overhead_per_row_s=0.0)
    knob = _serving_cost(iteration_overhead_s=0.002, iteration_overhead_per_row_s=0.0005)
    for B in (1, 3, 8):
        ctx, ranks = [130] * B, [(8, 64, 16)[i % 3] for i in range(B)]
        assert zero.decode_s(ctx, ranks) == plain.decode_s(ctx, ranks)
        assert knob.decode_s(ctx, ranks) == pytest.approx(plain.decode_s(ctx, ranks) + 0.002 + 0.0005 * B)
    assert knob.prefill_s([128, 64], [8, 8]) == pytest.approx(plain.prefill_s([128, 64], [8, 8]) + 0.002)  # decode only


def test_fit_overheads_recovers_slope_and_intercept():
    from bench.fidelity.families import fit_overheads

    assert fit_overheads([1, 2, 4, 8], [0.004 + 0.0007 * b for b in (1, 2, 4, 8)]) == pytest.approx((0.004, 0.0007))
    assert fit_overheads([1], [0.003]) == (0.003, 0.0)
    assert fit_overheads([1, 2, 4], [0.003, 0.002, 0.001]) == pytest.approx((0.002, 0.0))  # no negative slope
    c0, c1 = fit_overheads([1, 2, 4], [0.0005, 0.0015, 0.0035])  # intercept -0.0005 dropped: through the origin
    assert c0 == 0.0 and c1 == pytest.approx((0.0005 + 2 * 0.0015 + 4 * 0.0035) / 21)


def test_serving_profile_fits_per_row_overhead_from_decode_steps_at_batch_B():
    from bench.fidelity.families import _serving
    from impl.common.api import RunResult
    from impl.common.workloads.serving import LlamaShape, ServingWorkload

    wl = ServingWorkload(model=LlamaShape(hidden=512, ffn_hidden=1376, heads=8, kv_heads=8, num_layers=4, vocab=1024))
    roof = _serving_cost(iteration_overhead_s=0.0)
    ranks = [8, 64, 16, 32, 8, 8, 64, 16]
    # synthetic profile: each step = its roofline + 4 ms + 0.7 ms per row (keys as a JSON record has them)
    steps = {str(B): roof.decode_s([129] * B, ranks[:B]) + 0.004 + 0.0007 * B for B in (1, 2, 4, 8)}
    info = {"isolated_tpot_s": 0.006, "isolated_prompt_len": 128, "isolated_rank": 8,
            "isolated_decode_by_batch_s": steps, "isolated_decode_batch_ranks": ranks, "isolated_decode_kernel": "bgmv"}
    prof = _serving(RunResult(metrics={}, info=info), wl, _hw())
    cost = prof.system["cost"]
    assert cost["iteration_overhead_s"] == pytest.approx(0.004)
    assert cost["iteration_overhead_per_row_s"] == pytest.approx(0.0007)
    assert "least squares" in prof.sources["cost.iteration_overhead_per_row_s"]
    # without the batch profile: the fit has batch 1 only, so no per-row term
    old = {k: v for k, v in info.items() if "batch" not in k and "kernel" not in k}
    assert "iteration_overhead_per_row_s" not in _serving(RunResult(metrics={}, info=old), wl, _hw()).system["cost"]


def test_a_calibrated_profile_without_the_diffusion_rates_is_refused_before_the_real_run(tmp_path):
    from types import SimpleNamespace

    from bench.fidelity.families import DIFFUSION_RATES, get_family
    from impl.common.api import ConfigError
    from impl.common.hardware import DiffusionRates, HardwareProfile

    fam, wl = get_family("diffusion"), SimpleNamespace(dtype="fp32")
    fam.check_hw(HardwareProfile(name="cpu-2core"), wl, "cpu-2core")  # datasheet: fallbacks by design
    full = {f: {"fp32": 1e9} for f in DIFFUSION_RATES}
    fam.check_hw(HardwareProfile(name="local-t1", measured=True, diffusion=DiffusionRates(**full)), wl, "local-t1")
    stale = {**full, "conv_window_flops": {}, "token_gather_bytes_per_s": {"fp16": 1e9}}
    with pytest.raises(ConfigError, match=r"^system.sim_hardware: calibrated profile local-t1 lacks "
                                          r"diffusion.conv_window_flops\[fp32\], diffusion.token_gather_bytes_per_s\[fp32\] "):
        fam.check_hw(HardwareProfile(name="local-t1", measured=True, diffusion=DiffusionRates(**stale)), wl, "local-t1")
    # the preset with a stale profile stops in preflight, one line, before any real work
    path = _fixture_profile(tmp_path)
    rc, last = inprocess_runner([sys.executable, "-m", "bench", "experiment=fidelity/diffusion",
                                 f"system.sim_hardware={path}", f"results_dir={tmp_path}"], tmp_path)
    assert rc == 1 and "lacks diffusion.conv_flops[fp32]" in last and "\n" not in last.strip()


def _cold_prefills(cost, L, per_layer, layers=((8, 1), (16, 1), (32, 2), (64, 4)), warm=0.040):
    """Synthetic isolated prefills: cold = resident + the sim's own CPU-path extra + per_layer x n."""
    out = []
    for r, n in layers:
        base = cost.prefill_s([L], [r]) / cost.num_layers
        priced = n * cost.cpu_layer_extra_s(((L, r),), base, overhead=False)
        out.append({"rank": r, "cpu_layers": n, "warm_s": warm, "cold_s": warm + priced + per_layer * n})
    return out


def test_cpu_layer_overhead_is_the_cold_prefills_excess_beyond_max_base_cpu_per_layer():
    from bench.fidelity.families import cpu_layer_overhead

    hidden = _serving_cost(iteration_overhead_s=0.0)  # the CPU path hides behind the device layer
    per, src = cpu_layer_overhead(hidden, 128, _cold_prefills(hidden, 128, 0.0012))
    assert per == pytest.approx(0.0012) and "per CPU layer" in src and "(least squares 0.00 ms +" in src  # per layer
    # a slow host CPU: the sim already charges part of the cold prefill; only the rest is overhead
    slow = _serving_cost(iteration_overhead_s=0.0, cpu_cores=1, cpu_flops_per_core=1e8)
    assert slow.cpu_layer_extra_s(((128, 64),), slow.prefill_s([128], [64]) / slow.num_layers) > 0
    assert cpu_layer_overhead(slow, 128, _cold_prefills(slow, 128, 0.0012))[0] == pytest.approx(0.0012)
    assert cpu_layer_overhead(hidden, 128, _cold_prefills(hidden, 128, -0.001))[0] == 0.0  # never negative
    assert cpu_layer_overhead(hidden, 128, [{"rank": 8, "cpu_layers": 0, "warm_s": 0.04, "cold_s": 0.041}])[0] == 0.0
    # one pair preempted on a shared host (+60 ms on its cold prefill) does not set the value
    noisy = _cold_prefills(hidden, 128, 0.0012, layers=((8, 1), (16, 1), (32, 2), (64, 2), (8, 1)))
    noisy[1]["cold_s"] += 0.060
    assert cpu_layer_overhead(hidden, 128, noisy)[0] == pytest.approx(0.0012)


def test_serving_profile_takes_cpu_workers_and_cpu_layer_overhead():
    from bench.fidelity.families import _serving
    from impl.common.api import RunResult
    from impl.common.workloads.serving import LlamaShape, ServingWorkload

    wl = ServingWorkload(model=LlamaShape(hidden=512, ffn_hidden=1376, heads=8, kv_heads=8, num_layers=4, vocab=1024))
    info = {"isolated_tpot_s": 0.006, "isolated_prompt_len": 128, "isolated_rank": 8, "cpu_workers": 1}
    hidden = _serving_cost(iteration_overhead_s=0.0)
    info["isolated_cpu_prefills"] = _cold_prefills(hidden, 128, 0.0009)
    prof = _serving(RunResult(metrics={}, info=info), wl, _hw())
    assert prof.system["cost"]["cpu_cores"] == 1
    assert prof.system["cost"]["cpu_layer_overhead_s"] == pytest.approx(0.0009, rel=1e-6)
    assert "per CPU layer" in prof.sources["cost.cpu_layer_overhead_s"]
    # a policy without the CPU path (no worker, no profile): the knob stays at its default
    del info["isolated_cpu_prefills"], info["cpu_workers"]
    assert "cpu_layer_overhead_s" not in _serving(RunResult(metrics={}, info=info), wl, _hw()).system["cost"]
