"""Multi-process real paths on tiny models (gloo, forkserver): equality with the one-process path."""
import pytest

from impl.swiftdiffusion.bal import expected_patch_step
from impl.swiftdiffusion.bal_run import run_bal
from impl.swiftdiffusion.cfg_parallel import run_cfg
from impl.swiftdiffusion.controlnet_service import run_service

from .conftest import tiny_workload

pytestmark = pytest.mark.real


def test_remote_controlnet_residuals_equal_local_and_lru_caches():
    wl = tiny_workload()
    wl.num_steps, wl.requests = 3, 2
    wl.control_guidance_start = 0.34  # the first step runs without ControlNets on both paths
    r = run_service(wl, 0, 2, [0.5, 0.8], cache_size=1)
    assert r["max_abs_diff"] <= 1e-5 * r["ref_abs_max"]
    for s in r["servers"]:  # the same ControlNet per server: one cold load, then hits
        assert s["misses"] == 1 and s["hits"] == wl.requests and s["cached"] <= s["capacity"]


def test_latent_parallel_cfg_equals_batched():
    wl = tiny_workload()
    wl.num_steps, wl.requests = 4, 1
    r = run_cfg(wl, 0)
    assert r["max_abs_diff"] <= 1e-5 * r["ref_abs_max"]


def test_bal_k0_bit_identical_patch_step_and_pristine():
    wl = tiny_workload()
    wl.num_steps, wl.requests = 8, 2
    wl.lora_paper_bytes = 0.04e9  # ~0.12 s per emulated read: done part-way through 8 steps
    r = run_bal(wl, 0, [0, 2, 7])
    assert r["k0_equal"] and all(r["k0_equal"])
    assert all(r["pristine_after"])
    for v, steps in r["patch"].items():
        k = int(v[1:])
        for p, first in zip(steps, r["first_done"][v]):
            assert p == expected_patch_step(first, k)
    # fp16 LoRA files: both Diffusers paths see the values our fp16 buffers hold (fp32 tolerance;
    # their unfuse-by-subtraction drift is the remainder)
    for v in ("diffusers_model", "diffusers_pipeline"):
        assert len(r[f"{v}_vs_sync_max_rel"]) == wl.requests and max(r[f"{v}_vs_sync_max_rel"]) <= 1e-5
    assert r["pipeline"] == "StableDiffusionControlNetPipeline (ControlNetModel)"
    assert sum(r["loads"]) == 2 * (wl.requests + 1) * len(r["patch"])


def test_channels_last_service_and_cfg_parallel_equal_the_nchw_loop():
    """The backbone flag in the multi-process loops: NHWC UNet/ControlNets on every rank, the
    latents within the fp32 tolerance of the default-layout one-process loop."""
    import torch

    from impl.swiftdiffusion.denoise import denoise
    from impl.swiftdiffusion.models import build_bundle, request_inputs

    wl = tiny_workload()
    wl.num_steps, wl.requests = 3, 1
    b = build_bundle(wl, 0)
    r = run_service(wl, 0, 1, [0.5], cache_size=1, channels_last=True)
    assert r["nhwc"] and all(s["nhwc"] for s in r["servers"])
    inp = request_inputs(wl, wl.requests, 1, b)  # the last request's inputs (seed * 1000 + r)
    ref = denoise(b.unet, b.scheduler, inp, wl.num_steps, wl.guidance_scale, controlnets=[b.controlnets["cn-0"]],
                  scales=[0.5], split=False)
    assert (r["last_latents"] - ref).abs().max() <= 1e-5 * ref.abs().max()
    c = run_cfg(wl, 0, channels_last=True)
    assert c["nhwc"] == [True, True]
    ref = denoise(b.unet, b.scheduler, request_inputs(wl, wl.requests, 0, b), wl.num_steps, wl.guidance_scale,
                  split=False)
    assert (c["last_latents"] - ref).abs().max() <= 1e-5 * ref.abs().max()
