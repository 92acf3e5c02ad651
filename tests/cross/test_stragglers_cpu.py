"""The measured stragglers question (experiment=cross/stragglers_cpu): a slow GPU in the real
pipeline runtime stretches only its stage's padded ops, by its factor, and changes no number
the model computes; the shared hybrid CPU workload maps onto the pipeline runtime's op pad."""
from __future__ import annotations

import dataclasses

import pytest

from impl.common.api import ConfigError
from impl.common.runtime.executor import NamedSchedule, PipelineJob, run_pipeline
from impl.common.workloads.hybrid import HybridModelShape, HybridWorkload, as_pipeline


def _hybrid(**kw):
    base = dict(model=HybridModelShape(name="gpt-tiny", num_layers=8, hidden=64, heads=4, ffn_mult=4, vocab=256,
                                       seq_len=32),
                num_gpus=4, gpus_per_node=1, dp=1, tp=1, pp=4, global_batch_size=24, micro_batch_size=2,
                layer_fwd_pad_s=0.010, layer_bwd_pad_s=0.020, torch_threads=1)
    base.update(kw)
    return HybridWorkload(**base)


def test_per_layer_pads_become_one_op_pad_per_stage():
    wl = as_pipeline(_hybrid())
    assert (wl.stages, wl.num_microbatches, wl.torch_threads) == (4, 12, 1)
    assert wl.op_pad_s == pytest.approx(0.020)  # 2 layers per stage x 10 ms
    assert as_pipeline(_hybrid(layer_fwd_pad_s=0.0, layer_bwd_pad_s=0.0)).op_pad_s == 0.0
    with pytest.raises(ConfigError, match=r"^workload\.layer_bwd_pad_s: a pipeline op pads backward as 2x forward"):
        as_pipeline(_hybrid(layer_bwd_pad_s=0.030))
    with pytest.raises(ConfigError, match=r"^workload\.pp: 3 does not divide model\.num_layers 8"):
        as_pipeline(_hybrid(pp=3, num_gpus=3))


def test_slowdown_needs_one_factor_per_rank_and_a_pad():
    wl = dataclasses.replace(as_pipeline(_hybrid()), iterations=1, warmup_iterations=0)
    sched = NamedSchedule("1f1b", 4, 12)
    with pytest.raises(ConfigError, match=r"^slowdown: one factor >= 1 per rank \(4\)"):
        PipelineJob(sched, wl, op_pad_s=0.01, slowdown=[2.0, 1.0])
    with pytest.raises(ConfigError, match=r"^slowdown: a slow rank stretches its padded op time; set op_pad_s > 0"):
        PipelineJob(sched, wl, op_pad_s=0.0, slowdown=[2.0, 1.0, 1.0, 1.0])


@pytest.mark.real
def test_a_slow_rank_doubles_only_its_own_padded_ops_and_trains_the_same_model():
    wl = dataclasses.replace(as_pipeline(_hybrid()), num_microbatches=4, iterations=2, warmup_iterations=0)
    sched = NamedSchedule("1f1b", 4, 4)
    pad = 0.02  # well above the raw compute of a tiny op on a loaded host, so padding decides the time
    free = run_pipeline(PipelineJob(sched, wl, op_pad_s=pad))
    slow = run_pipeline(PipelineJob(sched, wl, op_pad_s=pad, slowdown=[2.0, 1.0, 1.0, 1.0]))
    assert slow.losses == free.losses and slow.params_digest == free.params_digest
    f0, f1 = slow.padded_compute_s[0]["F"], slow.padded_compute_s[1]["F"]  # same op count per rank
    assert f0 / f1 == pytest.approx(2.0, rel=0.15)
    g0, g1 = free.padded_compute_s[0]["F"], free.padded_compute_s[1]["F"]
    assert g0 / g1 == pytest.approx(1.0, rel=0.15)
