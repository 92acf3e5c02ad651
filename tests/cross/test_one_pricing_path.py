"""One pricing path (each system's README, same title): every training system's baseline is priced by the shared Megatron
step model, so slowing the step model's GEMM table (every GEMM 1.5x longer) must slow the
baseline of a paper preset of each system. A system that priced its baseline by its own formula
(a FLOP count over peak x mfu, a published table) would not move, and this fails."""
from __future__ import annotations

import dataclasses

import pytest

from bench.config import compose_config
from bench.system_choice import choice_of
from bench.validate import typed_job
from impl.common.api import JobContext
from impl.common.hardware import GemmSeries, HardwareProfile
from impl.common.megatron.derive import step_profile

GEMM_SCALE = 1.5
MIN_MOVE = 1.02  # the least a baseline's price must move when every GEMM takes GEMM_SCALE x longer

# (preset, baseline system, extra overrides that keep the job short, metric, "time" | "rate")
CASES = [
    ("hotspa/sim_matrix", "megatron_static", ["workload=hotspa_7b_8gpu_cc", "system.sim.contexts=[8192]"],
     "step_time_s", "time"),
    ("hydraulis/s3", "megatron_like", ["workload.steps=1"], "tokens_per_s", "rate"),
    ("lobra/e2e_7b", "task_fused", [], "gpu_seconds", "time"),
    ("malleus/s1", "uniform", [], "straggler_free_iteration_time_s", "time"),
    ("adaptra/microbench_7b", "zb", [], "iteration_time_s", "time"),
    ("ckpt_recovery/s1", "dcp_async", [], "info:base_step_s", "time"),
]


def _gemm_scaled(hw: HardwareProfile, scale: float) -> HardwareProfile:
    base = step_profile(hw)
    gemm = [dataclasses.replace(g, s=[t * scale for t in g.s]) for g in base.megatron.kernels.gemm]
    kernels = dataclasses.replace(base.megatron.kernels, gemm=gemm, source=f"{base.megatron.kernels.source} x{scale} GEMM")
    # a new name: nothing cached per profile name may hand back the unscaled price
    return dataclasses.replace(base.with_megatron(kernels=kernels), name=f"{base.name}-gemm-x{scale}")


def _price(preset: str, system: str, extra: list[str], metric: str, scale: float, tmp_path) -> float:
    cfg = compose_config([f"experiment={preset}", f"system={choice_of(system)}", *extra])
    job = typed_job(cfg)
    hw = _gemm_scaled(job.hardware, scale) if scale != 1.0 else step_profile(job.hardware)
    ctx = JobContext(mode="sim", seed=0, experiment=preset, workload=job.workload, workload_name="w",
                     hardware=hw, hardware_name=hw.name, fault=job.fault, fault_name="f", out_dir=tmp_path)
    result = job.system.run(ctx)
    assert result.status == "ok", (preset, system, result.invalid_reasons)
    if metric.startswith("info:"):
        return float(result.info[metric[len("info:"):]])
    return float(result.metrics[metric].value)


def test_gemm_scaled_table_is_a_real_change():
    hw = step_profile(typed_job(compose_config(["experiment=malleus/s1"])).hardware)
    slow = _gemm_scaled(hw, GEMM_SCALE)
    assert all(s == pytest.approx(GEMM_SCALE * t) for g0, g1 in zip(hw.megatron.kernels.gemm, slow.megatron.kernels.gemm)
               for t, s in zip(g0.s, g1.s))
    assert isinstance(slow.megatron.kernels.gemm[0], GemmSeries) and slow.megatron.knobs == hw.megatron.knobs


@pytest.mark.parametrize("preset,system,extra,metric,kind", CASES, ids=[c[0] for c in CASES])
def test_slower_gemm_table_slows_each_training_systems_baseline(preset, system, extra, metric, kind, tmp_path):
    plain = _price(preset, system, extra, metric, 1.0, tmp_path)
    slow = _price(preset, system, extra, metric, GEMM_SCALE, tmp_path)
    # GEMMs are the bulk of a step but not all of it (attention, elementwise, communication,
    # host overheads): the price moves by a visible share, and never by more than the GEMM scale.
    moved = slow / plain if kind == "time" else plain / slow
    assert moved > MIN_MOVE, (preset, system, metric, plain, slow)
    assert moved <= GEMM_SCALE * (1 + 1e-9), (preset, system, metric, plain, slow)
