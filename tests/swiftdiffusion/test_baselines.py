"""Baselines: Nirvana-like approximate caching, NoLoRA; the channels_last backbone flag."""
import copy
import math
import types

import pytest
import torch
from diffusers import StableDiffusionImg2ImgPipeline

from impl.common.api import ConfigError
from impl.swiftdiffusion.baselines import nirvana_request, nirvana_start_step, run_quality
from impl.swiftdiffusion.denoise import denoise, new_scheduler, to_channels_last
from impl.swiftdiffusion.models import build_bundle, request_inputs
from impl.swiftdiffusion.profile import SimProfile
from impl.swiftdiffusion.real import EQUAL_RTOL
from impl.swiftdiffusion.sim.serving import simulate_diffusers, simulate_katz
from impl.swiftdiffusion.sim.run import _sequential
from impl.swiftdiffusion.system import SwiftDiffusionSystem

from .conftest import tiny_workload


@pytest.mark.parametrize("steps,k", [(50, 10), (50, 20), (30, 10), (30, 20), (6, 10), (7, 0)])
def test_nirvana_start_step_is_diffusers_img2img_at_strength_1_minus_k_over_50(bundle, steps, k):
    sched = new_scheduler(bundle.scheduler, steps)
    fake = types.SimpleNamespace(scheduler=sched)
    ts, n = StableDiffusionImg2ImgPipeline.get_timesteps(fake, steps, 1.0 - k / 50, "cpu")
    start = nirvana_start_step(steps, k)
    assert steps - n == start and torch.equal(ts, sched.timesteps[start:])
    if steps == 50:
        assert start == k
    with pytest.raises(ConfigError, match=r"system.nirvana_k \(steps skipped of 50\) must be in 0..49, got 50"):
        nirvana_start_step(steps, 50)


@torch.no_grad()
def test_nirvana_runs_the_last_steps_from_the_renoised_cached_latent(bundle, wl):
    steps, k = 10, 20  # start step 4 of 10
    inp = request_inputs(wl, 5, 0, bundle)
    cached = torch.randn(inp["noise"].shape, generator=torch.Generator().manual_seed(9))
    out = nirvana_request(bundle.unet, bundle.scheduler, inp, cached, steps, wl.guidance_scale, k)
    # the same by hand: re-noise the cached latent to the start timestep, run the remaining steps
    s = copy.deepcopy(bundle.scheduler)
    s.set_timesteps(steps)
    start = 4
    s.set_begin_index(start)
    z = s.add_noise(cached, inp["noise"], s.timesteps[start:start + 1])
    emb = torch.cat([inp["uncond"], inp["cond"]])
    for t in s.timesteps[start:]:
        x = s.scale_model_input(torch.cat([z, z]), t)
        eu, ec = bundle.unet(x, t, encoder_hidden_states=emb).sample.chunk(2)
        z = s.step(eu + wl.guidance_scale * (ec - eu), t, z).prev_sample
    torch.testing.assert_close(out, z, rtol=1e-5, atol=1e-5)
    full = denoise(bundle.unet, bundle.scheduler, inp, steps, wl.guidance_scale)
    assert not torch.allclose(out, full, atol=1e-3)  # it did start from the cache, not from noise


def test_quality_scenario_nolora_is_pristine_and_orders_baselines():
    wl = tiny_workload(lora_ranks=[4, 8])
    r = run_quality(wl, 0, [0, 3], [10, 20])
    fresh = build_bundle(wl, 0, num_controlnets=0)
    inp = request_inputs(wl, 1, 0, fresh)  # the last request's inputs (seed * 1000 + 1)
    pristine = denoise(fresh.unet, fresh.scheduler, inp, wl.num_steps, wl.guidance_scale)
    assert torch.equal(r["last"]["nolora"], pristine)  # NoLoRA = the pristine model's output
    assert all(r["pristine_after"])
    q = {v: x[0] for v, x in r["quality"].items()}
    assert math.isinf(q["k0"][0])  # patch at step 0 = the synchronous merge
    assert math.isfinite(q["nolora"][0]) and math.isfinite(q["nirvana10"][0])  # the LoRA effect is there
    assert r["nirvana_start"] == {10: 2, 20: 3}  # 6 steps: int(6 * 0.8) = 4 run, int(6 * 0.6) = 3 run


@torch.no_grad()
def test_channels_last_flag_matches_default_layout(bundle, wl):
    unet = copy.deepcopy(bundle.unet)
    to_channels_last(unet)
    assert unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert not bundle.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    emb = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
    one = unet(x.contiguous(memory_format=torch.channels_last), torch.tensor(400), encoder_hidden_states=emb).sample
    torch.testing.assert_close(one, bundle.unet(x, torch.tensor(400), encoder_hidden_states=emb).sample,
                               rtol=1e-5, atol=1e-5)
    inp = request_inputs(wl, 3, 0, bundle)
    ref = denoise(bundle.unet, bundle.scheduler, inp, 4, wl.guidance_scale)
    out = denoise(unet, bundle.scheduler, inp, 4, wl.guidance_scale, channels_last=True)
    # random weights grow the latents to ~1e3; the layouts differ by summation order only
    assert (out - ref).abs().max() <= EQUAL_RTOL * ref.abs().max()


def test_sim_nirvana_skips_k_steps_on_a_hit_and_nolora_pays_no_lora():
    p = SimProfile()
    for c, lo in [(0, 1), (1, 1), (3, 2)]:
        q = _sequential(c, lo)
        full = simulate_diffusers(q, p, 1, 3, 0, "local").done[-1].latency
        for k in (10, 20):
            hit = simulate_diffusers(q, p, 1, 3, 0, "local", skip_steps=k).done[-1].latency
            assert hit == pytest.approx(full - k * p.diffusers_step_s(c))
        miss = simulate_diffusers(q, p, 1, 3, 0, "local", skip_steps=10, hit_rate=0.0).done[-1].latency
        assert miss == pytest.approx(full)
        nol = simulate_katz(q, p, 1, max(1, 2 * c), 20, lora_cache=0, slots=1, drop_loras=True).done[-1].latency
        with_l = simulate_katz(q, p, 1, max(1, 2 * c), 20, lora_cache=0, slots=1).done[-1].latency
        assert nol == pytest.approx(p.katz_latency(c, 0, 20, 0.0)) and nol < with_l
    with pytest.raises(ConfigError, match=r"system.nirvana_hit_rate must be in \[0, 1\], got 1.5"):
        simulate_diffusers(q, p, 1, skip_steps=10, hit_rate=1.5)


def test_baseline_variants_preflight():
    s = SwiftDiffusionSystem(SwiftDiffusionSystem.Config(variant="nirvana", nirvana_k=10), "swiftdiffusion_nirvana")
    wl = tiny_workload(scenario="quality", k_grid=[0, 2])
    s.check("real", wl, None, None)
    wl.scenario = "bal"
    with pytest.raises(ConfigError, match=r"system.variant: nirvana runs real scenario\(s\) quality only"):
        s.check("real", wl, None, None)
    with pytest.raises(ConfigError, match=r"system.nirvana_k \(steps skipped\) must be >= 0, got -1"):
        SwiftDiffusionSystem(SwiftDiffusionSystem.Config(nirvana_k=-1), "x")


def test_sim_distrifusion_matches_artifact_rows_and_is_e1_only():
    from impl.swiftdiffusion.sim.run import ARTIFACT_DISTRIFUSION
    from impl.common.workloads.diffusion_serving import DiffusionServingWorkload

    p = SimProfile()
    for (c, lo), ref in ARTIFACT_DISTRIFUSION.items():
        assert abs(p.distrifusion_latency(c, lo) / ref - 1) <= (0.01 if (c, lo) != (3, 2) else 0.15), (c, lo)
    # patch parallelism shortens the steps but keeps diffusers' LoRA loading on the path
    assert p.distrifusion_latency(2, 2) < p.diffusers_latency(2, 2)
    assert p.distrifusion_latency(0, 2) - p.distrifusion_latency(0, 0) == pytest.approx(0.74 * p.diffusers_lora_s(2))
    s = SwiftDiffusionSystem(SwiftDiffusionSystem.Config(variant="distrifusion"), "swiftdiffusion_distrifusion")
    wl = DiffusionServingWorkload()
    wl.sim.scenario = "e1"
    s.check("sim", wl, None, None)
    wl.sim.scenario = "e2"
    with pytest.raises(ConfigError, match="system.variant: distrifusion is modelled for E1 only"):
        s.check("sim", wl, None, None)
