"""Latent (CFG) parallelism (as in the authors' code; real experiment C of README.md): rank 0 runs
the conditional branch, rank 1 the unconditional one; each step rank 1 sends eps_uncond to rank 0,
which applies the guidance and the scheduler step and broadcasts the next (scaled) model input. The
same job times the batch-2 CFG loop in one process (interleaved) and compares the latents. With
``channels_last`` both loops run the UNet NHWC; tensors cross gloo in the default (contiguous NCHW)
layout."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from impl.common.runtime.launch import RankContext, launch

from impl.swiftdiffusion.denoise import denoise, new_scheduler, to_channels_last
from impl.swiftdiffusion.models import build_bundle, request_inputs
from impl.common.execution import set_torch_threads


@torch.no_grad()
def cfg_parallel_denoise(rank: int, unet, scheduler, inp, steps: int, guidance: float,
                         channels_last: bool = False) -> torch.Tensor:
    sched = new_scheduler(scheduler, steps)
    z = inp["noise"] * sched.init_noise_sigma
    emb = inp["cond"] if rank == 0 else inp["uncond"]
    x = torch.empty_like(z)
    for t in sched.timesteps:
        if rank == 0:  # the scheduler lives on rank 0 only (its step index advances there)
            x = sched.scale_model_input(z, t).contiguous()  # NHWC eps leave z channels_last; gloo sends NCHW
        dist.broadcast(x, 0)
        xin = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        eps = unet(xin, t, encoder_hidden_states=emb, return_dict=False)[0]
        if rank == 1:
            dist.send(eps.contiguous(), 0)
        else:
            eu = torch.empty(eps.shape, dtype=eps.dtype)  # contiguous NCHW, whatever layout eps has
            dist.recv(eu, 1)
            z = sched.step(eu + guidance * (eps - eu), t, z, return_dict=False)[0]
    return z if rank == 0 else None


def _main(ctx: RankContext, wl, seed: int, channels_last: bool = False):
    set_torch_threads(max(1, wl.torch_threads))
    b = build_bundle(wl, seed, num_controlnets=0)
    if channels_last:
        to_channels_last(b.unet)
    par_t, bat_t, diffs, scale = [], [], [], 0.0
    for r in range(wl.requests + 1):  # request 0 = warm-up
        inp = request_inputs(wl, seed * 1000 + r, 0, b)
        order = ("par", "bat") if r % 2 == 0 else ("bat", "par")
        res = {}
        for which in order:
            dist.barrier()
            t0 = time.perf_counter()
            if which == "par":
                res[which] = cfg_parallel_denoise(ctx.rank, b.unet, b.scheduler, inp, wl.num_steps, wl.guidance_scale,
                                                  channels_last)
            elif ctx.rank == 0:
                res[which] = denoise(b.unet, b.scheduler, inp, wl.num_steps, wl.guidance_scale, split=False,
                                     channels_last=channels_last)
            dt = time.perf_counter() - t0
            if r > 0:
                (par_t if which == "par" else bat_t).append(dt)
        if ctx.rank == 0:
            diffs.append(float((res["par"] - res["bat"]).abs().max()))
            scale = max(scale, float(res["bat"].abs().max()))
    nhwc = b.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    if ctx.rank:
        return dict(nhwc=nhwc)
    return dict(parallel_s=par_t, batched_s=bat_t, max_abs_diff=max(diffs), ref_abs_max=scale,
                last_latents=res["par"], nhwc=[nhwc])


def run_cfg(wl, seed: int, timeout_s: float = 900.0, channels_last: bool = False) -> dict:
    out = launch(_main, 2, (wl, seed, channels_last), label="latent parallelism", timeout_s=timeout_s).results
    res = out[0]
    res["nhwc"] += [x["nhwc"] for x in out[1:]]  # per rank: the layout the UNet ran in
    return res
