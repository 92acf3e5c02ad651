"""Target-area capture and per-layer masks, as in the authors' code (`Hankpipi/diffusers-hetu`).

Online capture: D_i = minmax(sum_c |z_i^edit - z_i^orig|) for the first k steps,
S = uint8(255 * minmax(sum_i D_i)), M = S > Otsu(S) (scikit-image), then a 2x2 opening.
Offline variant: histogram equalisation, fixed threshold 64, the same opening.
Per-layer masks: max-pool the latent mask to each layer's grid.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from impl.common.api import ConfigError

OPENING = np.ones((2, 2), dtype=bool)


def minmax(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.min(), x.max()
    if float(hi - lo) == 0.0:
        return torch.zeros_like(x)
    return (x - lo) / (hi - lo)


def difference_map(z_edit: Sequence[torch.Tensor], z_orig: Sequence[torch.Tensor]) -> np.ndarray:
    """S = uint8(255 * minmax(sum_i minmax(sum_c |z_i^edit - z_i^orig|))) over the given steps."""
    if len(z_edit) != len(z_orig) or not z_edit:
        raise ValueError(f"mask capture needs matching latents, got {len(z_edit)} edit and {len(z_orig)} original")
    acc = None
    for ze, zo in zip(z_edit, z_orig):
        if ze.shape != zo.shape:
            raise ValueError(f"mask capture: latent shapes differ {tuple(ze.shape)} vs {tuple(zo.shape)}")
        d = (ze.float().cpu() - zo.float().cpu()).abs()
        d = d.reshape(-1, *d.shape[-3:]).sum(dim=(0, 1))  # channels (and a batch of 1) -> (H, W)
        d = minmax(d)
        acc = d if acc is None else acc + d
    return (255.0 * minmax(acc)).to(torch.uint8).numpy()


def opening(m: np.ndarray) -> np.ndarray:
    from scipy import ndimage

    return ndimage.binary_opening(m, structure=OPENING)


def otsu_mask(S: np.ndarray) -> tuple[np.ndarray, float]:
    from skimage.filters import threshold_otsu

    if S.min() == S.max():
        return np.zeros_like(S, dtype=bool), float(S.max())
    t = float(threshold_otsu(S))
    return opening(S > t), t


def offline_mask(S: np.ndarray, threshold: int = 64) -> np.ndarray:
    from skimage.exposure import equalize_hist

    eq = equalize_hist(S, nbins=256)
    lo, hi = eq.min(), eq.max()  # OpenCV's equalizeHist maps the lowest level to 0 (cdf - cdf_min)
    eq = np.zeros_like(eq) if hi == lo else (eq - lo) / (hi - lo)
    eq = (255.0 * eq).astype(np.uint8)
    return opening(eq > threshold)


def capture_mask(z_edit, z_orig, method: str = "otsu") -> tuple[torch.Tensor, dict]:
    S = difference_map(z_edit, z_orig)
    if method == "otsu":
        m, t = otsu_mask(S)
        info = {"method": "otsu", "threshold": t}
    elif method == "offline":
        m = offline_mask(S)
        info = {"method": "offline", "threshold": 64}
    else:
        raise ConfigError(f"system.mask_method: unknown method {method!r} (one of: otsu, offline)")
    info["ratio"] = float(m.mean())
    return torch.from_numpy(m.copy()), info


def check_pool_factors(latent_hw: tuple[int, int], factors: Sequence[int]) -> None:
    H, W = latent_hw
    bad = [f for f in factors if H % f or W % f]
    if bad:
        raise ConfigError(f"workload.unet.sample_size: latent {H}x{W} is not divisible by pool factor(s) "
                          f"{', '.join(map(str, bad))} of the UNet (needs multiples of {max(factors)}; pad the image, "
                          f"never clip)")


def layer_mask(mask: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """Max-pool a latent mask (H0, W0) to a layer grid (h, w): a cell is active if any latent pixel in it is."""
    H0, W0 = mask.shape
    h, w = hw
    if (h, w) == (H0, W0):
        return mask.bool()
    if H0 % h or W0 % w or H0 // h != W0 // w:
        raise ConfigError(f"workload.unet.sample_size: latent {H0}x{W0} does not pool onto a {h}x{w} layer grid "
                          f"(factor must divide both sides)")
    k = H0 // h
    return F.max_pool2d(mask.float()[None, None], k)[0, 0] > 0


def check_mask(mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    if tuple(mask.shape) != tuple(latent_hw):
        raise ConfigError(f"workload.mask: mask shape {tuple(mask.shape)} does not match the latent {tuple(latent_hw)} "
                          f"(resize it to the latent grid; it is never clipped)")
    return mask.bool()


def synthetic_mask(hw: tuple[int, int], ratio: float, shape: str = "rect", seed: int = 0) -> torch.Tensor:
    """A mask covering ~``ratio`` of the latent: one rectangle, or smooth random blobs."""
    H, W = hw
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"workload.mask_ratio must be in [0, 1], got {ratio}")
    g = torch.Generator().manual_seed(seed)
    if ratio == 0.0:
        return torch.zeros(H, W, dtype=torch.bool)
    if shape == "rect":
        area = ratio * H * W
        h = min(H, max(1, round(math.sqrt(area * H / W))))
        w = min(W, max(1, round(area / h)))
        top = int(torch.randint(0, H - h + 1, (1,), generator=g))
        left = int(torch.randint(0, W - w + 1, (1,), generator=g))
        m = torch.zeros(H, W, dtype=torch.bool)
        m[top:top + h, left:left + w] = True
        return m
    if shape == "blob":
        noise = torch.randn(1, 1, H, W, generator=g)
        k = max(3, (min(H, W) // 6) | 1)
        x = torch.arange(k, dtype=torch.float32) - k // 2
        g1 = torch.exp(-x ** 2 / (2 * (k / 4) ** 2))
        kern = (g1[:, None] * g1[None, :])
        smooth = F.conv2d(noise, (kern / kern.sum())[None, None], padding=k // 2)[0, 0]
        thr = torch.quantile(smooth.flatten(), 1.0 - ratio)
        return smooth >= thr
    raise ConfigError(f"workload.mask_shape: unknown shape {shape!r} (one of: rect, blob)")
