"""The tiny random-weight models of the real experiments (README.md) and per-request inputs."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Optional

import torch

from impl.common.api import ConfigError
from impl.common.diffusion.pipelines import build_controlnet, build_scheduler, build_unet


def controlnet_factor(cn) -> int:
    """Down-sampling of the conditioning embedding: cond side = latent side x factor."""
    return 2 ** (len(cn.config.conditioning_embedding_out_channels) - 1)


def check_cond(cond: torch.Tensor, cn, latent_hw, what: str = "workload.cond_size") -> None:
    f = controlnet_factor(cn)
    want = (cn.config.conditioning_channels, latent_hw[0] * f, latent_hw[1] * f)
    if tuple(cond.shape[-3:]) != want:
        raise ConfigError(f"{what}: ControlNet conditioning is {tuple(cond.shape[-3:])}, the ControlNet needs "
                          f"{want} (latent {tuple(latent_hw)} x {f})")


@dataclass
class Bundle:
    """Base UNet, scheduler, ControlNets (by id) and the saved files a server loads from."""

    unet: object
    scheduler: object
    controlnets: dict
    directory: Optional[pathlib.Path] = None

    def latent_hw(self, shape) -> tuple:
        return (shape.sample_size, shape.sample_size)


def build_bundle(wl, seed: int, num_controlnets: Optional[int] = None, save_dir=None, device=None,
                 dtype: Optional[torch.dtype] = None) -> Bundle:
    """The models, built on ``device`` (the job's ``execution``; None = the CPU) and cast to
    ``dtype`` (None = fp32). Building under the device lets a GPU initialise its own weights
    (an SD-1.5-sized UNet takes seconds to initialise on a CPU)."""
    with torch.device(device or "cpu"):
        unet = build_unet(wl.unet, seed)
        unet.requires_grad_(False)
        n = wl.num_controlnets_built if num_controlnets is None else num_controlnets
        cns = {}
        for i in range(n):
            cn = build_controlnet(unet, seed + 100 + i, wl.cond_channels)
            cn.requires_grad_(False)
            cns[f"cn-{i}"] = cn
    if dtype is not None:
        unet.to(dtype)
        for cn in cns.values():
            cn.to(dtype)
    b = Bundle(unet, build_scheduler(wl.scheduler), cns)
    if save_dir is not None:
        root = pathlib.Path(save_dir)
        for k, cn in cns.items():
            cn.save_pretrained(root / k)
        b.directory = root
    return b


def request_inputs(wl, seed: int, n_cn: int, bundle: Bundle, device=None, dtype: Optional[torch.dtype] = None) -> dict:
    """Random prompt embeddings (cond, uncond), initial noise and control images of one request,
    drawn on the CPU (the same values on every device) and moved to ``device`` / ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    hw = bundle.latent_hw(wl.unet)
    c = wl.unet.cross_attention_dim
    cond = torch.randn(1, wl.text_len, c, generator=g)
    uncond = torch.randn(1, wl.text_len, c, generator=g)
    noise = torch.randn(1, wl.unet.in_channels, *hw, generator=g)
    images = []
    ids = list(bundle.controlnets)[:n_cn]
    size = wl.cond_size
    for k in ids:
        cn = bundle.controlnets[k]
        side = size if size else hw[0] * controlnet_factor(cn)
        img = torch.rand(1, cn.config.conditioning_channels, side, side, generator=g)
        check_cond(img, cn, hw)
        images.append(img)
    if device is not None or dtype is not None:
        to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
        cond, uncond, noise, images = to(cond), to(uncond), to(noise), [to(i) for i in images]
    return dict(cond=cond, uncond=uncond, noise=noise, cn_ids=ids, cn_images=images)
