"""Quality baselines of the authors' evaluation scripts (`Hankpipi/diffusers-hetu`), built from
stock diffusers pipelines (real mode, random weights).

| system  | pipeline                                   | input                                   |
|---------|--------------------------------------------|-----------------------------------------|
| sdedit  | StableDiffusionImg2ImgPipeline, strength s | the original image, the edited prompt   |
| inpaint | StableDiffusionInpaintPipeline (9-channel  | the original image, the FISEdit mask    |
|         | inpainting UNet, SD2-inpainting's layout)  | upsampled to pixels, the edited prompt  |

Both report time and pixel-space fidelity outside the mask against the original image
(``psnr_outside_image_db``), the figure FISEdit reports too. With random weights the
paper's semantic metrics (CLIP similarities) are meaningless, so none are claimed.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from impl.common.api import ConfigError, JobContext, Metric, RunResult, System
from impl.common.diffusion.pipelines import build_components, sd_pipeline
from impl.common.diffusion.quality import psnr, ssim
from impl.common.host_alloc import host_malloc_in_force

from impl.fisedit.mask import check_pool_factors
from impl.fisedit.real import make_mask


class QualityBaselineKind(enum.StrEnum):
    """The quality baselines: SDEdit (re-noise and denoise the whole image) or masked inpainting."""

    sdedit = "sdedit"
    inpaint = "inpaint"


class QualityBaseline(System):
    modes = ("real",)

    @dataclass
    class Config:
        kind: QualityBaselineKind = QualityBaselineKind.sdedit
        strength: float = 0.75  # sdedit (the authors' SDEdit script: 0.75, about 37 of 50 steps)

    def __init__(self, cfg, name):
        super().__init__(cfg, name)
        if cfg.kind not in ("sdedit", "inpaint"):
            raise ConfigError(f"system.kind: unknown value {cfg.kind!r} (one of: sdedit, inpaint)")
        if not 0.0 < cfg.strength <= 1.0:
            raise ConfigError(f"system.strength must be in (0, 1], got {cfg.strength}")

    def run(self, job: JobContext) -> RunResult:
        wl = job.workload
        if getattr(wl, "kind", None) != "diffusion_edit":
            raise ConfigError(f"workload.kind: {self.name} needs a diffusion_edit workload")
        malloc = host_malloc_in_force(wl.host_malloc)
        job.execution.apply_threads(wl.torch_threads)
        device = job.execution.torch_device()
        dtype = job.execution.torch_dtype(wl.dtype)
        hw = (wl.unet.sample_size, wl.unet.sample_size)
        check_pool_factors(hw, wl.unet.pool_factors())
        comps = build_components(wl.unet, job.seed, wl.scheduler, device=str(device), dtype=dtype)
        t2i = sd_pipeline(comps, "text2img")
        scale = t2i.vae_scale_factor
        g = torch.Generator("cpu").manual_seed(job.seed)
        z = torch.randn((1, wl.unet.in_channels, *hw), generator=g).to(device, dtype)
        common = dict(negative_prompt="", num_inference_steps=wl.num_steps, guidance_scale=wl.guidance_scale,
                      output_type="pt")
        orig = t2i(prompt=wl.prompt, latents=z.clone(), height=hw[0] * scale, width=hw[1] * scale, **common).images

        class _P:  # make_mask only needs the latent grid
            latent_hw = hw

        mask = make_mask(job, _P, wl.mask_ratio if wl.mask_ratio is not None else 0.1)
        pix_mask = F.interpolate(mask[None, None].float(), scale_factor=scale, mode="nearest")[0, 0] > 0
        times, outs, steps = [], [], wl.num_steps
        for _ in range(wl.repeats):
            gen = torch.Generator("cpu").manual_seed(job.seed)
            t0 = time.perf_counter()
            if self.cfg.kind == "sdedit":
                pipe = sd_pipeline(comps, "img2img")
                out = pipe(prompt=wl.edited_prompt, image=orig, strength=self.cfg.strength, generator=gen, **common)
                steps = int(wl.num_steps * self.cfg.strength)
            else:
                out = self._inpaint(job, comps, orig, pix_mask, gen, common)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            outs.append(out.images)
        edit = outs[-1]
        metrics = {
            "e2e_time_s": Metric.from_samples(times, "s", "lower"),
            "denoise_steps": Metric.scalar(steps, "steps", "lower"),
            "psnr_outside_image_db": Metric.scalar(min(psnr(orig, edit, ~pix_mask, 1.0), 999.0), "dB", "higher"),
            "ssim_outside_image": Metric.scalar(ssim(orig[0], edit[0], ~pix_mask, 1.0), "ssim", "higher"),
        }
        return RunResult(metrics=metrics, info={"kind": self.cfg.kind, "strength": self.cfg.strength, "host_malloc": malloc,
                                                "mask_ratio": float(mask.float().mean())})

    def _inpaint(self, job, comps, orig, pix_mask, gen, common):
        wl = job.workload
        shape = dataclasses.replace(wl.unet, in_channels=9)  # SD2-inpainting: latent + mask + masked latent
        ic = build_components(shape, job.seed + 100, wl.scheduler, roundtrip=False,
                              device=str(orig.device), dtype=orig.dtype)
        ic.vae, ic.text_encoder, ic.tokenizer = comps.vae, comps.text_encoder, comps.tokenizer
        pipe = sd_pipeline(ic, "inpaint")
        h, w = orig.shape[-2:]
        return pipe(prompt=wl.edited_prompt, image=orig, mask_image=pix_mask[None, None].float(), height=h, width=w,
                    strength=1.0, generator=gen, **common)
