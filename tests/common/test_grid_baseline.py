"""The grid-rule Megatron baseline (the grid of the authors' Megatron-LM fork,
`Sakura-gh/Megatron-LM` `long_seq:benchmark/generate_benchmark_scripts.py`) on the calibrated step model: the grid the
authors' generator tried, only fitting layouts kept, the winner the fastest of them."""
from __future__ import annotations

from impl.common.baselines.megatron_grid import GridRule, GridRuleConfig
from impl.common.varlen.sampling import LengthStream
from impl.common.megatron.grid import MBS, candidates, model_of, step_prices

from tests.support.inprocess import run_job


def test_grid_has_tp_across_nodes_and_every_mbs_and_respects_heads_and_layers():
    c = candidates(32, 8, 60, 64, 512)
    assert any(g.tp == 16 for g in c) and any(g.tp == 32 for g in c)
    assert {g.mbs for g in c} == set(MBS)
    assert all(64 % g.tp == 0 and 60 % g.pp == 0 and g.dp * g.tp * g.pp == 32 for g in c)
    assert not any(g.tp == 16 for g in candidates(16, 8, 40, 40, 512))  # 40 heads: no tp 16


def test_best_grid_is_the_fastest_fitting_layout(tmp_path):
    from bench.config import compose_config as cc
    from bench.validate import typed_job

    job = typed_job(cc(["system=hotspa/megatron_grid", "workload=hotspa_7b_8gpu_cc", "hardware=a800-80g-megatron",
                        "mode=sim", "workload.context=8192", "workload.global_batch_seqs=64"]))
    wl, hw = job.workload, job.hardware
    stream = LengthStream(wl.lengths, 1)
    batches = [stream.by_count(wl.global_batch_seqs) for _ in range(2)]
    model = model_of(wl)
    best, info = GridRule(GridRuleConfig(), wl, hw).search(batches)
    times = {}
    for g in candidates(wl.num_gpus, wl.gpus_per_node, model.num_layers, model.heads, 64):
        est = step_prices(model, g, batches, wl.context, hw, wl.gpus_per_node)
        if est.fits:
            times[g] = est.iteration_s
    assert info["grid_fit"] == len(times) and times[best] == min(times.values())


def test_megatron_grid_job_is_priced_by_the_step_model(tmp_path):
    res = run_job(["system=hotspa/megatron_grid", "workload=hotspa_7b_8gpu_cc", "hardware=a800-80g-megatron", "mode=sim",
                   "workload.context=4096", "workload.steps=2"], tmp_path)
    assert res.info["megatron_step_model"] is True and res.metrics["step_time_s"].value > 0
    assert res.info["strategies"][0].endswith(tuple(f"mbs {m}" for m in MBS))
