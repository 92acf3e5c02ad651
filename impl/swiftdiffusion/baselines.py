"""Real quality baselines on the tiny models (those of the artifact's quality comparison): latents
of Katz's patch-at-K, Nirvana-like approximate caching and NoLoRA against the reference (LoRAs
merged before step 0, the synchronous merge = what Diffusers' load + fuse computes).

* **Nirvana-K**: img2img from a cached similar result with strength 1 - K/50 (the artifact's
  version): the cached final latents of a similar request (same LoRAs, prompt embeddings
  perturbed, other noise) are re-noised to the start timestep and the remaining steps run.
* **NoLoRA**: the same loop on the pristine weights (the quality floor: the LoRA effect must be
  visible against it).
* **Katz patch-at-K**: the LoRAs merged before step K, in process (the loaders' timing is
  scenario ``bal``; here only the patch step matters).
Random weights show the mechanics and the ordering, not image quality."""
from __future__ import annotations

import tempfile
import time

import torch

from impl.common.api import ConfigError
from impl.common.diffusion.quality import psnr, ssim

from impl.swiftdiffusion.bal_run import make_lora_files
from impl.swiftdiffusion.denoise import denoise, to_channels_last
from impl.swiftdiffusion.lora import TargetTable, load_direct, merge, restore
from impl.swiftdiffusion.models import build_bundle, request_inputs


def nirvana_start_step(num_steps: int, k: int, of_steps: int = 50) -> int:
    """The first step run by img2img at strength 1 - k/of_steps (diffusers' ``get_timesteps``)."""
    if not 0 <= k < of_steps:
        raise ConfigError(f"system.nirvana_k (steps skipped of {of_steps}) must be in 0..{of_steps - 1}, got {k}")
    strength = 1.0 - k / of_steps
    init = min(int(num_steps * strength), num_steps)
    return max(num_steps - init, 0)


def similar_inputs(inp: dict, seed: int, prompt_noise: float) -> dict:
    """A cached request 'similar' to ``inp``: prompt embeddings perturbed, its own initial noise."""
    g = torch.Generator().manual_seed(seed)
    out = dict(inp)
    for key in ("cond", "uncond"):
        out[key] = inp[key] + prompt_noise * torch.randn(inp[key].shape, generator=g).to(inp[key])
    out["noise"] = torch.randn(inp["noise"].shape, generator=g).to(inp["noise"])
    return out


@torch.no_grad()
def nirvana_request(unet, scheduler, inp: dict, cached: torch.Tensor, steps: int, guidance: float, k: int,
                    channels_last: bool = False):
    """Nirvana-K: the last steps of the loop from the cached result re-noised at the start timestep."""
    start = nirvana_start_step(steps, k)
    return denoise(unet, scheduler, inp, steps, guidance, start_step=start, init_latents=cached,
                   channels_last=channels_last)


@torch.no_grad()
def run_quality(wl, seed: int, k_grid, nirvana_ks, prompt_noise: float = 0.1, channels_last: bool = False,
                device=None, dtype=None) -> dict:
    """``device`` / ``dtype``: the job's execution (None: the CPU in fp32)."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    b = build_bundle(wl, seed, num_controlnets=0, device=device, dtype=dtype)
    if channels_last:
        to_channels_last(b.unet)
    table = TargetTable.build(b.unet)
    steps, gs = wl.num_steps, wl.guidance_scale
    n_l = len(wl.lora_ranks)
    times = {}
    quality = {}
    pristine_equal = []
    with tempfile.TemporaryDirectory(prefix="mlsys-lora-") as d:
        paths = make_lora_files(wl, seed, b.unet, d)
        loras = [load_direct(p, table, f"#{i}") for i, p in enumerate(paths)]

        def timed(name, fn, r):
            t0 = time.perf_counter()
            z = fn()
            if on_cuda:
                torch.cuda.synchronize(device)
            if r > 0:
                times.setdefault(name, []).append(time.perf_counter() - t0)
            return z

        def with_loras(idx, fn):
            touched = merge(table, [loras[i] for i in idx])
            try:
                return fn()
            finally:
                restore(table, touched)

        for r in range(wl.requests + 1):  # request 0 = warm-up
            idx = list(range((r % 2) * n_l, (r % 2) * n_l + n_l))
            inp = request_inputs(wl, seed * 1000 + r, 0, b, device=device, dtype=dtype)
            sim_inp = similar_inputs(inp, seed * 1000 + r + 500, prompt_noise)
            # the cache holds the similar request's full result (computed earlier, not timed)
            cached = with_loras(idx, lambda: denoise(b.unet, b.scheduler, sim_inp, steps, gs, channels_last=channels_last))
            out = {"reference": timed("reference", lambda: with_loras(
                idx, lambda: denoise(b.unet, b.scheduler, inp, steps, gs, channels_last=channels_last)), r)}
            out["nolora"] = timed("nolora", lambda: denoise(b.unet, b.scheduler, inp, steps, gs,
                                                            channels_last=channels_last), r)
            for k in nirvana_ks:
                out[f"nirvana{k}"] = timed(f"nirvana{k}", lambda k=k: with_loras(
                    idx, lambda: nirvana_request(b.unet, b.scheduler, inp, cached, steps, gs, k, channels_last)), r)
            for k in k_grid:
                def patched(k=k):
                    touched = set()

                    def hook(i):
                        if i == k:
                            touched.update(merge(table, [loras[j] for j in idx]))
                    try:
                        return denoise(b.unet, b.scheduler, inp, steps, gs, before_step=hook,
                                       channels_last=channels_last)
                    finally:
                        restore(table, touched)
                out[f"k{k}"] = timed(f"k{k}", patched, r)
            if r > 0:
                ref = out["reference"]
                for v, z in out.items():
                    if v != "reference":
                        quality.setdefault(v, []).append((psnr(ref, z), ssim(ref[0], z[0])))
            pristine_equal.append(all(torch.equal(s.weight, s.pristine) for s in table.sites.values()))
    return dict(times=times, quality=quality, pristine_after=pristine_equal,
                nirvana_start={k: nirvana_start_step(steps, k) for k in nirvana_ks}, last=out)
