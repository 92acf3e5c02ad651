"""CaraServe's knobs: the cost model's live in one nested node with one default each, and every
whole-job check fails at preflight, before the first job of a sweep."""
from __future__ import annotations

import dataclasses

import pytest

from bench.app import preflight
from bench.config import compose_config
from bench.validate import typed_job
from impl.caraserve.system import ServingSystem
from impl.common.servesim.cost import ServingCost, ServingCostConfig
from tests.conftest import run_bench

S1 = ["system=caraserve/caraserve", "workload=serving_s1_7b_a10", "hardware=a10", "mode=sim"]


def test_cost_knobs_have_one_name_and_one_default():
    knobs = {f.name: f.default for f in dataclasses.fields(ServingCostConfig)}
    cost_fields = {f.name: f.default for f in dataclasses.fields(ServingCost)}
    assert {k: cost_fields[k] for k in knobs} == knobs  # the sim's cost does not redefine a knob
    flat = {f.name for f in dataclasses.fields(ServingSystem.Config)}
    assert not flat & set(knobs), "a cost knob is also a flat system knob"
    # The values every README figure was measured with (the system's, which overrode ServingCost's).
    assert (knobs["bgmv_efficiency"], knobs["mbgmv_efficiency"], knobs["h2d_efficiency"]) == (1.0, 0.5, 0.69)


def test_nested_override_reaches_the_sim_cost():
    from impl.caraserve.sim import build_cost
    from impl.common.api import JobContext

    cfg = compose_config([*S1, "+system.cost.mbgmv_efficiency=0.25", "+system.cost.cpu_cores=8"])
    job = typed_job(cfg)
    ctx = JobContext(mode="sim", seed=0, experiment="t", workload=job.workload, workload_name="s1",
                     hardware=job.hardware, hardware_name="a10", fault=job.fault, fault_name="none",
                     out_dir=None, show_progress=False)
    cost = build_cost(job.system, ctx)
    assert (cost.mbgmv_efficiency, cost.cpu_cores, cost.bgmv_efficiency) == (0.25, 8, 1.0)
    assert cost.h2d_bytes_per_s == pytest.approx(job.hardware.host_link_bw_bytes_per_s * 0.69)


@pytest.mark.parametrize("overrides, expected", [
    (["+system.bgmv_efficiency=0.7"], "system.bgmv_efficiency: Key 'bgmv_efficiency' not in 'Config'"),
    (["+system.cost.bgmv_efficiency=0"], "system.cost.bgmv_efficiency must be > 0, got 0.0"),
    (["+system.cost.typo=1"], "system.cost.typo: Key 'typo' not in 'ServingCostConfig'"),
    (["workload.paper_model.ffn_hidden=0"], "workload.paper_model.ffn_hidden: the serving cost model is LLaMA's"),
    (["workload=pipeline_s4"], "workload.kind: caraserve needs a 'serving' workload, got 'pipeline'"),
    (["mode=real", "+workload.model.kv_heads=3"], "model.heads 4 is not divisible by model.kv_heads 3"),
])
def test_refused_at_preflight(overrides, expected):
    error = preflight([*S1, *overrides])
    assert error is not None and error.startswith(expected) and "\n" not in error, error


def test_sweep_with_a_wrong_workload_kind_fails_before_its_first_job(tmp_path):
    proc = run_bench(["--multirun", "system=caraserve/caraserve,caraserve/ondmd", "workload=pipeline_s4", "hardware=a10", "mode=sim",
                      f"results_dir={tmp_path}"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "workload.kind: caraserve needs a 'serving' workload, got 'pipeline'" in lines[0]
    assert not (tmp_path / "records.jsonl").exists()
