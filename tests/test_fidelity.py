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


SIM_PIPELINE = ["system=zb", "mode=sim", "workload=pipeline_s4", "workload.num_microbatches=4",
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
    # another host's measurement is not this machine's
    assert store.family_fidelity(store.store_path(None, results), "pipeline", host="elsewhere") is None
    assert family_of("diffusion_edit") == "diffusion" and family_of("varlen") == "varlen"


def test_real_records_carry_no_family_fidelity(tmp_path):
    rec = _run(["system=calibrate", "mode=real", f"system.output={tmp_path / 'hw.yaml'}",
                "system.p2p_sizes_bytes=[8,1024]", "system.allreduce_sizes_bytes=[8]", "system.repeats=3",
                "system.matmul_sizes=[64]", "system.mem_bw_bytes=1048576", "system.max_seconds_per_measurement=0.05",
                "validity.max_foreign_cpu_frac=null"], tmp_path / "runs")
    assert "fidelity" not in rec["provenance"]


def test_wrong_family_for_the_workload_is_one_line(tmp_path):
    rc, last = inprocess_runner([sys.executable, "-m", "bench", "system=fidelity", "mode=real",
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
    assert saved["hosts"][host]["pipeline"]["zb"]["run_id"] == rec["run_id"]
    rows = fidelity_rows(load_records(results))
    assert [(r["family"], r["metric"]) for r in rows] == [("pipeline", "iteration_time_s")]
    assert "error %" in format_rows(rows)
