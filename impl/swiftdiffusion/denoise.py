"""The denoising loop shared by Katz and its baselines: batch-2 CFG (diffusers semantics),
optional ControlNets (local, or remote through a residual source), and a per-step hook (the
BAL patch point). diffusers' ``StableDiffusionControlNetPipeline`` runs the same arithmetic."""
from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence

import torch

from impl.common.api import ConfigError

from impl.swiftdiffusion import split_unet
from impl.swiftdiffusion.aggregation import Aggregation

AGGREGATIONS = tuple(Aggregation)


def controlnet_keep(i: int, n: int, start: float, end: float) -> float:
    """diffusers' per-step ControlNet switch (``control_guidance_start/end``)."""
    return 1.0 - float(i / n < start or (i + 1) / n > end)


def check_guidance(start: float, end: float) -> None:
    if not 0.0 <= start < end <= 1.0:
        raise ConfigError(f"workload.control_guidance_start/end: need 0 <= start < end <= 1, got {start}, {end}")


def aggregate(results: Sequence[tuple], scales: Sequence[float], mode: str = "sum"):
    """N ControlNets' (down residuals, mid residual) into one pair.

    ``sum``: diffusers ``MultiControlNetModel`` (each output already times its own scale, summed).
    ``katz_mean``: the Katz code's mean over ControlNets with one shared scale (labelled variant).
    ``results`` hold unscaled residuals (conditioning_scale=1)."""
    if mode not in AGGREGATIONS:
        raise ConfigError(f"system.aggregation: unknown value {mode!r} (one of: {', '.join(AGGREGATIONS)})")
    if not results:
        return None, None
    if mode == "katz_mean":
        s = scales[0] / len(results)
        scales = [s] * len(results)
    down = None
    mid = None
    for (d, m), s in zip(results, scales):
        d = [x * s for x in d]
        m = m * s
        down = d if down is None else [a + b for a, b in zip(down, d)]
        mid = m if mid is None else mid + m
    return down, mid


def run_controlnet(cn, x, t, emb, image, scale: float = 1.0):
    d, m = cn(x, t, encoder_hidden_states=emb, controlnet_cond=image, conditioning_scale=scale, return_dict=False)
    return list(d), m


def to_channels_last(*models) -> None:
    """The channels_last backbone flag (a config flag of the authors' code): NHWC conv weights, in
    place. LoRA targets are Linear layers (2-D weights), so merge/restore are unaffected."""
    for m in models:
        m.to(memory_format=torch.channels_last)


def new_scheduler(scheduler, steps: int):
    s = copy.deepcopy(scheduler)
    s.set_timesteps(steps)
    return s


@torch.no_grad()
def denoise(unet, scheduler, inputs: dict, steps: int, guidance: float, *, controlnets: Sequence = (),
            scales: Sequence[float] = (), aggregation: str = "sum", guidance_start: float = 0.0,
            guidance_end: float = 1.0, residuals: Optional[Callable] = None,
            before_step: Optional[Callable[[int], None]] = None, split: bool = True,
            start_step: int = 0, init_latents: Optional[torch.Tensor] = None,
            channels_last: bool = False) -> torch.Tensor:
    """Batch-2 CFG denoising; returns the final latents.

    ``residuals`` (``start(x, t)`` before the down half, ``finish(handle)`` -> (down, mid) after
    it) replaces the local ControlNets (the remote service);
    ``before_step(i)`` runs before step i (BAL's patch check). ``start_step``/``init_latents``
    start part-way (img2img from a cached result: Nirvana). ``channels_last`` feeds the UNet NHWC
    inputs (the backbone flag; the caller converts the model with :func:`to_channels_last`)."""
    sched = new_scheduler(scheduler, steps)
    ts = sched.timesteps
    if init_latents is None:
        z = inputs["noise"] * sched.init_noise_sigma
    else:
        z = sched.add_noise(init_latents, inputs["noise"], ts[start_step:start_step + 1]) if start_step else init_latents
        if hasattr(sched, "set_begin_index"):
            sched.set_begin_index(start_step)
    emb = torch.cat([inputs["uncond"], inputs["cond"]])
    images = [torch.cat([im, im]) for im in inputs.get("cn_images", [])][:len(controlnets) or None]
    n = len(ts)
    for i in range(start_step, n):
        t = ts[i]
        if before_step is not None:
            before_step(i)
        x = sched.scale_model_input(torch.cat([z, z]), t)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        keep = controlnet_keep(i, n, guidance_start, guidance_end)
        if residuals is not None:
            handle = residuals.start(x, t) if keep else None  # before the down half: they overlap
            state = split_unet.down(unet, x, t, emb)
            d, m = residuals.finish(handle) if keep else (None, None)
            eps = split_unet.mid_up(unet, state, d, m)
        else:
            d = m = None
            if controlnets and keep:
                outs = [run_controlnet(cn, x, t, emb, im) for cn, im in zip(controlnets, images)]
                d, m = aggregate(outs, list(scales), aggregation)
            if split:
                eps = split_unet.split_forward(unet, x, t, emb, d, m)
            else:
                eps = unet(x, t, encoder_hidden_states=emb, down_block_additional_residuals=d,
                           mid_block_additional_residual=m, return_dict=False)[0]
        eu, ec = eps.chunk(2)
        z = sched.step(eu + guidance * (ec - eu), t, z, return_dict=False)[0]
    return z
