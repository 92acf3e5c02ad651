"""On a GPU (README "On a GPU"): SwiftDiffusion's single-process real paths run on the job's device (job.execution),
and the gpu/swiftdiffusion_sd15 preset composes and is refused without CUDA in one line."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench.config import compose_config
from bench.validate import typed_job
from impl.common.api import ConfigError, JobContext
from impl.common.execution import Execution
from impl.swiftdiffusion.system import SwiftDiffusionSystem

from .conftest import tiny_workload

PRESET = ["experiment=gpu/swiftdiffusion_sd15"]


def _job(wl, tmp_path, execution):
    return JobContext("real", 0, "t", wl, "w", None, "h", None, "none", tmp_path, execution=execution)


def test_lora_api_runs_on_the_executions_device(tmp_path):
    system = SwiftDiffusionSystem(SwiftDiffusionSystem.Config(), "swiftdiffusion")
    wl = tiny_workload(scenario="lora_api", repeats=1)
    res = system.run(_job(wl, tmp_path, Execution(device="cpu")))
    assert res.info["device"] == "cpu" and res.info["dtype"] == "float32"
    assert res.metrics["direct_vs_load_fuse_x"].value > 0


def test_fp16_without_cuda_is_one_line(tmp_path):
    system = SwiftDiffusionSystem(SwiftDiffusionSystem.Config(), "swiftdiffusion")
    with pytest.raises(ConfigError, match="execution.dtype: fp16 needs a CUDA device") as e:
        system.run(_job(tiny_workload(scenario="lora_api"), tmp_path, Execution(device="cpu", dtype="fp16")))
    assert "\n" not in str(e.value)


def test_multirank_scenarios_leave_the_device_to_the_placement(tmp_path, monkeypatch):
    """controlnet / cfg put one model part per gloo rank on the CPU: the record's device comes
    from the launch's placement, not from the system."""
    import impl.swiftdiffusion.cfg_parallel as cp

    monkeypatch.setattr(cp, "run_cfg", lambda wl, seed, channels_last=False: {
        "parallel_s": [1.0], "batched_s": [1.0], "max_abs_diff": 0.0, "ref_abs_max": 1.0})
    system = SwiftDiffusionSystem(SwiftDiffusionSystem.Config(), "swiftdiffusion")
    res = system.run(_job(tiny_workload(scenario="cfg"), tmp_path, Execution(device="cpu")))
    assert "device" not in res.info and "gloo" in res.info["placement"]


def test_preset_composes_with_sd15_sizes():
    for scenario in ("bal", "lora_api"):
        job = typed_job(compose_config(PRESET + ["execution=cpu", f"workload.scenario={scenario}"]))
        u = job.workload.unet
        assert (u.sample_size, list(u.block_out_channels), u.layers_per_block, u.cross_attention_dim) == \
            (64, [320, 640, 1280, 1280], 2, 768)
        assert job.workload.num_controlnets == 1 and list(job.workload.lora_ranks) == [64]
        assert job.execution.dtype == "fp16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_preset_is_refused_without_cuda_in_one_line():
    p = subprocess.run([sys.executable, "-m", "bench", *PRESET], capture_output=True, text=True, timeout=120)
    out = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2 and len(out) == 1 and "cuda" in out[0], out
