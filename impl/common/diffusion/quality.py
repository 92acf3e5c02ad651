"""Quality metrics on latents/images (scikit-image implementations, masked variants).

Masked PSNR runs scikit-image's PSNR over the selected elements only; masked SSIM averages
scikit-image's full SSIM map over the selected pixels. ``data_range`` defaults to the
reference's own range (max - min), which is what a latent has instead of [0, 255].
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def _select(x: np.ndarray, mask: Optional[np.ndarray]) -> np.ndarray:
    if mask is None:
        return x.reshape(-1)
    m = np.broadcast_to(mask.astype(bool), x.shape)
    return x[m]


def psnr(reference, test, mask=None, data_range: Optional[float] = None) -> float:
    """PSNR in dB of ``test`` against ``reference`` over the cells where ``mask`` (H, W) is true.
    Identical inputs give +inf (reported as such, never clipped)."""
    from skimage.metrics import peak_signal_noise_ratio

    ref, tst = _np(reference), _np(test)
    m = None if mask is None else _np(mask).astype(bool)
    r, t = _select(ref, m), _select(tst, m)
    if r.size == 0:
        return float("nan")
    rng = float(data_range if data_range is not None else ref.max() - ref.min())
    if np.array_equal(r, t):
        return math.inf
    return float(peak_signal_noise_ratio(r, t, data_range=rng))


def ssim(reference, test, mask=None, data_range: Optional[float] = None) -> float:
    """Mean SSIM over channels (the leading dims are flattened into channels) and masked pixels."""
    from skimage.metrics import structural_similarity

    ref, tst = _np(reference), _np(test)
    H, W = ref.shape[-2:]
    ref2, tst2 = ref.reshape(-1, H, W), tst.reshape(-1, H, W)
    rng = float(data_range if data_range is not None else ref.max() - ref.min())
    win = min(7, H if H % 2 else H - 1, W if W % 2 else W - 1)
    maps = [structural_similarity(a, b, data_range=rng, full=True, win_size=win)[1] for a, b in zip(ref2, tst2)]
    smap = np.mean(maps, axis=0)
    if mask is None:
        return float(smap.mean())
    m = _np(mask).astype(bool)
    return float(smap[m].mean()) if m.any() else float("nan")
