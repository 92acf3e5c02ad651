"""The Diffusers baseline as the full pipeline API (as in the artifact, `modelscope/Katz`): a
``StableDiffusionControlNetPipeline`` (``MultiControlNetModel`` for >1 ControlNet;
``StableDiffusionPipeline`` for none) over the tiny random-weight components, and per request
``load_lora_weights`` per LoRA, ``set_adapters``, ``fuse_lora``; afterwards ``unfuse_lora`` and
``unload_lora_weights``.

A LoRA is fetched from the (emulated) remote store into a local cache directory and loaded from
there: ``load_lora_weights`` reads alpha and r from the file's metadata only when it loads a file
(an in-memory state dict loses alpha), so the bytes the store returns are what diffusers reads.

The pipeline runs the arithmetic of :func:`impl.swiftdiffusion.denoise.denoise` (batch-2 CFG,
serial ControlNets summed, ``control_guidance_start/end``) through diffusers' own code: the
control image is pixel-space, so the tiny VAE down-samples by the ControlNet's factor and the
pipeline's default size (``unet.sample_size x vae_scale_factor``) is the control image's."""
from __future__ import annotations

import copy
import math
import pathlib
import contextlib
import logging
import time
from typing import Sequence

import torch

from impl.common.api import ConfigError
from impl.common.diffusion.pipelines import build_text_encoder, build_tokenizer, build_vae

from impl.swiftdiffusion.lora import WEIGHT_NAME
from impl.swiftdiffusion.models import Bundle, controlnet_factor


def vae_for(seed: int, latent_channels: int, factor: int, width: int = 16):
    """The tiny VAE whose down-sampling is the ControlNet's ``factor`` (log2(factor) + 1 blocks)."""
    blocks = int(round(math.log2(factor))) + 1
    if 2 ** (blocks - 1) != factor:
        raise ConfigError(f"workload.cond_channels: the ControlNet's down-sampling {factor} is not a power of 2")
    return build_vae(seed, latent_channels, width, blocks=blocks).requires_grad_(False)


def build_pipeline(bundle: Bundle, wl, seed: int, cn_ids: Sequence[str] = (), device=None, dtype=None):
    """The stock pipeline over a copy of the bundle's UNet (PEFT injects into it) and its
    ControlNets, moved once to ``device`` / ``dtype`` (``pipe.to``: every component follows)."""
    from diffusers import StableDiffusionControlNetPipeline, StableDiffusionPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    unet = copy.deepcopy(bundle.unet)
    cns = [bundle.controlnets[k] for k in cn_ids]
    factor = controlnet_factor(cns[0]) if cns else 8
    tok = build_tokenizer()
    kw = dict(vae=vae_for(seed + 2, wl.unet.in_channels, factor),
              text_encoder=build_text_encoder(wl.unet.cross_attention_dim, len(tok), seed + 1).requires_grad_(False),
              tokenizer=tok, unet=unet, scheduler=copy.deepcopy(bundle.scheduler), safety_checker=None,
              feature_extractor=None, requires_safety_checker=False)
    if cns:
        pipe = StableDiffusionControlNetPipeline(controlnet=cns[0] if len(cns) == 1 else MultiControlNetModel(cns), **kw)
    else:
        pipe = StableDiffusionPipeline(**kw)
    pipe.set_progress_bar_config(disable=True)
    if device is not None or dtype is not None:
        pipe.to(device=device, dtype=dtype)
    return pipe


def run_pipeline(pipe, wl, inp: dict, scales: Sequence[float] = ()) -> torch.Tensor:
    """One request through ``pipe(...)``; returns the final latents (``output_type="latent"``)."""
    kw = dict(prompt_embeds=inp["cond"], negative_prompt_embeds=inp["uncond"], latents=inp["noise"].clone(),
              num_inference_steps=wl.num_steps, guidance_scale=wl.guidance_scale, output_type="latent")
    images = inp.get("cn_images", [])
    if hasattr(pipe, "controlnet"):
        n = len(getattr(pipe.controlnet, "nets", [pipe.controlnet]))
        if len(images) != n:
            raise ConfigError(f"workload.num_controlnets: the request has {len(images)} control images, "
                              f"the pipeline {n} ControlNets")
        kw.update(image=images[0] if n == 1 else list(images),
                  controlnet_conditioning_scale=float(scales[0]) if n == 1 else [float(s) for s in scales[:n]],
                  control_guidance_start=wl.control_guidance_start, control_guidance_end=wl.control_guidance_end)
    return pipe(**kw).images


@contextlib.contextmanager
def _quiet_text_encoder_notice():
    """The files hold UNet LoRAs only: diffusers' notice that the text encoder gets none, per load, is noise."""
    log = logging.getLogger("diffusers.loaders.lora_base")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def pipeline_request(pipe, storage, paths, idx, wl, inp: dict, scales, cache_dir, timings: dict) -> torch.Tensor:
    """The Diffusers server's request: fetch each LoRA (emulated store) to the local cache,
    ``load_lora_weights``, ``set_adapters``, ``fuse_lora``; denoise; ``unfuse_lora``,
    ``unload_lora_weights``."""
    t = time.perf_counter()
    names = []
    for i in idx:
        local = pathlib.Path(cache_dir) / f"lora-{i}"
        local.mkdir(parents=True, exist_ok=True)
        (local / WEIGHT_NAME).write_bytes(storage.read_file(paths[i], wl.lora_paper_bytes))
        name = f"a{i}"
        with _quiet_text_encoder_notice():
            pipe.load_lora_weights(str(local), weight_name=WEIGHT_NAME, adapter_name=name)
        names.append(name)
    if names:
        pipe.set_adapters(names, [1.0] * len(names))
        pipe.fuse_lora(lora_scale=1.0, adapter_names=names, components=["unet"])
    timings.setdefault("pipeline_load_fuse_s", []).append(time.perf_counter() - t)
    try:
        return run_pipeline(pipe, wl, inp, scales)
    finally:
        t = time.perf_counter()
        if names:
            pipe.unfuse_lora(components=["unet"])
            pipe.unload_lora_weights()
        timings.setdefault("pipeline_unfuse_unload_s", []).append(time.perf_counter() - t)


def weight_drift(unet, pristine: dict) -> float:
    """max |W - W0| over the UNet's weights: diffusers' unfuse subtracts the delta back."""
    sd = unet.state_dict()
    return max(float((sd[k] - v).abs().max()) for k, v in pristine.items())
