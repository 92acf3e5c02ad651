"""Diffusion substrate shared by FISEdit and SwiftDiffusion.

- :mod:`.pipelines`: Stable-Diffusion-shaped components from real ``diffusers``/``transformers``
  classes, built from configs with random weights, saved and reloaded through
  ``save_pretrained``/``from_pretrained``; a CLIP tokenizer built in memory.
- :mod:`.quality`: image/latent quality metrics (PSNR, SSIM via scikit-image), masked variants.
- :mod:`.cost`: a per-op cost model of a UNet (op list traced on the meta device, roofline time).
"""
