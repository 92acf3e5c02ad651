"""A small results folder for the report tests: real sim records (two ADAPTRA systems of the
default run's sim step, run in this process), a failed and an invalid record, a calibration-like
harness record, synthetic hinge records (HotSPa's matrix_max_band over four inputs), and three bad
inputs (a torn line, a foreign JSON file, an unknown schema); and the site built from it."""
from __future__ import annotations

import copy
import json

import pytest
from bench.config import compose_config
from bench.hinges import points
from bench.record import write_record
from bench.runner import execute
from bench.system_choice import choice_of


def run_sim(results, experiment: str, system: str) -> dict:
    overrides = [f"experiment={experiment}", f"system={choice_of(system)}", f"results_dir={results}", "progress=false"]
    cfg = compose_config(overrides)
    return execute(cfg, overrides, choices={"system": system, "workload": "gpt7b_pp4", "hardware": "h800",
                                            "fault": "link_delay_60ms", "experiment": experiment})


@pytest.fixture(scope="session")
def report_results(tmp_path_factory):
    results = tmp_path_factory.mktemp("report") / "runs"
    ok = {s: run_sim(results, "demo/sim", s) for s in ("zb", "adaptra")}
    assert all(r["status"] == "ok" for r in ok.values()), [r["error"] for r in ok.values()]
    # An invalid run that would look best, and a failed one: shown, never compared.
    invalid = copy.deepcopy(ok["adaptra"])
    invalid.update(run_id=invalid["run_id"] + "-inv", status="invalid", created="2999-01-01T00:00:00+00:00",
                   invalid_reasons=["host contended: 60% foreign CPU"])
    invalid["metrics"]["iteration_time_s"]["value"] = 0.001
    write_record(results, invalid)
    failed = copy.deepcopy(ok["zb"])
    failed.update(run_id=failed["run_id"] + "-fail", status="failed", error="RuntimeError: boom", metrics={})
    write_record(results, failed)
    calib = copy.deepcopy(ok["zb"])
    calib.update(run_id="20260101T000000-calibrate-000000", system="calibrate", experiment="adhoc",
                 mode="real", workload="", hardware="local-cpu[2 cores]", fault="none",
                 metrics={"matmul_fp32_flops": {"value": 3e10, "unit": "flop/s", "better": "higher", "n": 3,
                                                "p50": 3e10, "p10": 2.9e10, "p90": 3.1e10}})
    calib["config"] = {"system": {"_target_": "bench.calibrate.system.Calibrate", "name": "calibrate"}}
    write_record(results, calib)
    # A real Malleus scenario-A record's shape: four plans interleaved in one job (hand-made
    # numbers; the report must draw one series per plan and mark it measured).
    mal = copy.deepcopy(ok["zb"])
    plans = ["uniform", "data_only", "layers_only", "malleus"]
    level = {"uniform": 2.9, "data_only": 1.5, "layers_only": 1.48, "malleus": 1.24}
    times = [3.0, 2.95] + [level[plans[i % 4]] + 0.01 * (i % 3) for i in range(12)]
    mal.update(run_id="20260101T000000-malleus-0000aa", system="malleus", experiment="malleus/cpu_static",
               mode="real", workload="malleus_cpu_dp2pp2", hardware="local-cpu[2 cores]", fault="slowdown_a",
               info={"iteration_times_s": times},
               metrics={"speedup_vs_uniform": {"value": 2.34, "unit": "x", "better": "higher", "n": 1,
                                               "p50": 2.34, "p10": 2.34, "p90": 2.34}})
    mal["config"] = {"system": {"_target_": "impl.malleus.system.HybridTraining", "name": "malleus",
                                "interleave": plans},
                     "workload": {"warmup_iterations": 2}, "figure": "impl.malleus.figures:iteration_trace"}
    mal["provenance"]["emulated"] = ["GPU compute: sleep-padded per layer and micro-batch (impl/malleus/README.md, 'Experiments')"]
    write_record(results, mal)
    # Bad input: a torn line, a foreign JSON document, a record of a schema version we don't know.
    with open(results / "records.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"schema": "mlsys-bench.record/1", "run_id": "torn')
        fh.write("\n")
    (results / "foreign").mkdir()
    (results / "foreign" / "record.json").write_text(json.dumps({"hello": "world"}))
    future = copy.deepcopy(ok["zb"])
    future.update(schema="mlsys-bench.record/9", run_id="future-run")
    (results / "future-run").mkdir()
    (results / "future-run" / "record.json").write_text(json.dumps(future))
    # The cross-paper page: one question's jobs, one of them refused in preflight (not applicable).
    cross = {}
    for system in ("zb", "malleus"):
        overrides = ["experiment=cross/stragglers", f"system={choice_of(system)}", "fault=link_delay_60ms",
                     "workload.iterations=2", "workload.warmup_iterations=0", f"results_dir={results}", "progress=false"]
        cross[system] = execute(compose_config(overrides), overrides,
                                choices={"system": system, "workload": "llama7b_dp4_pp8", "hardware": "h100-megatron",
                                         "fault": "link_delay_60ms", "experiment": "cross/stragglers"})
    assert cross["zb"]["status"] == "ok" and cross["malleus"].get("not_applicable"), cross["malleus"]["error"]
    hinges = write_hinge_records(results, ok["zb"])
    return {"dir": results, "ok": ok, "invalid": invalid, "failed": failed, "cross": cross, "hinges": hinges}


@pytest.fixture(scope="session")
def site(report_results, tmp_path_factory):
    from bench.report import main

    out = tmp_path_factory.mktemp("site")
    assert main(["--results", str(report_results["dir"]), "--out", str(out)]) == 0
    return out


# A small hinge declaration for HotSPa's matrix_max_band (band 2.5-3.2x, the max over workloads of
# HotSPa over megatron_static on step_time_s), with hand-made figures per point: the claim misses
# as composed (2.0x); bandwidth and the static's TP limit bring it in within their ranges, the
# overhead and sequence parallelism do not. A one-value input (sequence parallelism off) moves the
# figure most after bandwidth, though its span over its one value is zero.
HINGES = {
    "paper": "hotspa", "claims": ["matrix_max_band"],
    "inputs": [
        {"name": "inter-node bandwidth per NIC", "key": "hardware.inter_node_bw_bytes_per_s",
         "values": [3.125e9, 12.5e9, 50.0e9], "display": {"scale": 1e-9, "unit": "GB/s"},
         "source": "HDR/NDR InfiniBand per NIC", "kind": "profile"},
        {"name": "per-iteration overhead", "key": "hardware.megatron.knobs.iteration_overhead_s",
         "values": [0.0, 1.88], "composed": 0.952, "display": {"unit": "s"},
         "source": "0 to twice the fit", "kind": "profile"},
        {"name": "static baseline's TP limit", "key": "system.sim.static_max_tp", "values": [4, 16],
         "source": "the grid search in a node, or across two", "kind": "baseline", "systems": ["megatron_static"]},
        {"name": "sequence parallelism [R]", "key": "system.sim.sequence_parallel", "values": [False],
         "source": "Megatron TP without SP", "kind": "reconstructed"},
    ],
}
HINGE_FIGURES = [2.0, 1.4, 1.8, 2.9, 2.3, 1.7, 1.9, 2.6, 1.2]  # the max-workload figure at point 0..8
HINGE_WORKLOADS = {"hotspa_7b_8gpu_cc": 0.8, "hotspa_32b_32gpu_cc": 1.0}  # share of the point's figure


def write_hinge_records(results, template: dict) -> list[dict]:
    assert len(HINGE_FIGURES) == len(points(_typed_hinges())) + 1
    out = []
    for k, figure in enumerate(HINGE_FIGURES):
        for w, (workload, share) in enumerate(HINGE_WORKLOADS.items()):
            for system, step in (("megatron_static", 10.0), ("hotspa", 10.0 / (share * figure))):
                rec = copy.deepcopy(template)
                rec.update(run_id=f"20260102T0000{k:02d}-{system}-hinge{w}", system=system, experiment="hotspa/hinges",
                           mode="sim", workload=workload, hardware="a800-80g", fault="none", status="ok",
                           created=f"2026-01-02T00:00:{k:02d}+00:00",
                           metrics={"step_time_s": {"value": step, "unit": "s", "better": "lower", "n": 1,
                                                    "p50": step, "p10": step, "p90": step}})
                rec["config"] = {"system": {"_target_": "impl.hotspa.system.HotSPa", "name": system,
                                            "sim": {"static_max_tp": 8, "sequence_parallel": True}},
                                 "hardware": {"inter_node_bw_bytes_per_s": 25e9},
                                 "hinges": {**copy.deepcopy(HINGES), "point": k}}
                write_record(results, rec)
                out.append(rec)
    return out


def _typed_hinges():
    from bench.hinges import typed

    return typed(HINGES)
