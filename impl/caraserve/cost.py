"""CaraServe's rank-aware performance model (arXiv 2401.11240), fit by least squares.

Forms [R]:
- decode, BGMV (pads to max rank): T_dec = a0 + a1*B + a2*B*max r (+ a3*sum ctx)
- decode, MBGMV (no padding):      T_dec = a0 + a1*B + a2*sum r  (+ a3*sum ctx)
- prefill:                          T_pre = b0 + b1*sum L + b2*sum(L*r)
The fit keeps its coefficients and R^2; :meth:`RankCostModel.check` refuses to schedule with a
poor fit (R^2 < min_r2). The context term is an addition of ours: decode reads the KV cache,
and without it the model under-predicts long contexts. Coefficients are clipped at >= 0 so the
model is monotone (adding a request never lowers a prediction).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from impl.common.api import ConfigError


class PoorFitError(ConfigError):
    pass


def features_dec(ctx: Sequence[int], ranks: Sequence[int], kernel: str) -> list[float]:
    B = len(ranks)
    if not B:
        return [0.0, 0.0, 0.0, 0.0]
    lora = B * max(ranks) if kernel != "mbgmv" else sum(ranks)
    return [1.0, float(B), float(lora), float(sum(ctx))]


def features_pre(lens: Sequence[int], ranks: Sequence[int]) -> list[float]:
    if not lens:
        return [0.0, 0.0, 0.0]
    return [1.0, float(sum(lens)), float(sum(n * r for n, r in zip(lens, ranks)))]


def nnls_fit(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    from scipy.optimize import nnls

    coef, _ = nnls(X, y)
    pred = X @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return coef, r2


@dataclass
class RankCostModel:
    kernel: str
    dec_coef: list
    pre_coef: list
    dec_r2: float
    pre_r2: float
    min_r2: float = 0.9
    samples: int = 0

    def decode_s(self, ctx: Sequence[int], ranks: Sequence[int]) -> float:
        if not ranks:
            return 0.0
        return float(np.dot(self.dec_coef, features_dec(ctx, ranks, self.kernel)))

    def prefill_s(self, lens: Sequence[int], ranks: Sequence[int]) -> float:
        if not lens:
            return 0.0
        return float(np.dot(self.pre_coef, features_pre(lens, ranks)))

    def check(self) -> "RankCostModel":
        if self.dec_r2 < self.min_r2 or self.pre_r2 < self.min_r2:
            raise PoorFitError(f"system.min_r2: cost-model fit too poor to schedule on (decode R^2 {self.dec_r2:.3f}, "
                               f"prefill R^2 {self.pre_r2:.3f}, need >= {self.min_r2})")
        return self

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "decode_coef": self.dec_coef, "prefill_coef": self.pre_coef,
                "decode_r2": self.dec_r2, "prefill_r2": self.pre_r2, "min_r2": self.min_r2, "samples": self.samples}


def profile_grid(seed: int = 0, ranks=(8, 16, 32, 64)) -> tuple[list, list]:
    """The profiled grid [R] (impl/caraserve/README.md, "Reconstructed choices"): B in 1..64, r in {8,16,32,64}, L in 16..2048 (rank mixes
    drawn from a seeded RNG)."""
    rng = np.random.default_rng(seed)
    dec, pre = [], []
    for B in (1, 2, 4, 8, 16, 24, 32, 48, 64):
        for _ in range(6):
            rs = [int(x) for x in rng.choice(ranks, size=B)]
            ctx = [int(x) for x in rng.integers(16, 1024, size=B)]
            dec.append((ctx, rs))
    for n in (1, 2, 4, 8):
        for L in (16, 64, 256, 1024, 2048):
            for _ in range(3):
                lens = [max(16, int(L // n))] * n
                rs = [int(x) for x in rng.choice(ranks, size=n)]
                pre.append((lens, rs))
    return dec, pre


def fit(dec_samples: Sequence[tuple], pre_samples: Sequence[tuple], dec_time: Callable, pre_time: Callable,
        kernel: str = "bgmv", min_r2: float = 0.9) -> RankCostModel:
    """Least-squares (non-negative) fit from profiled runs: ``dec_time(ctx, ranks)`` and
    ``pre_time(lens, ranks)`` are the measurements (real timings or a profile's costs)."""
    Xd = np.array([features_dec(c, r, kernel) for c, r in dec_samples])
    yd = np.array([dec_time(c, r) for c, r in dec_samples])
    Xp = np.array([features_pre(l, r) for l, r in pre_samples])
    yp = np.array([pre_time(l, r) for l, r in pre_samples])
    cd, r2d = nnls_fit(Xd, yd)
    cp, r2p = nnls_fit(Xp, yp)
    return RankCostModel(kernel=kernel, dec_coef=[float(x) for x in cd], pre_coef=[float(x) for x in cp],
                         dec_r2=r2d, pre_r2=r2p, min_r2=min_r2, samples=len(dec_samples) + len(pre_samples))


def fit_with_law(dec_samples: Sequence[tuple], pre_samples: Sequence[tuple], base_dec_time: Callable,
                 dec_time: Callable, pre_time: Callable, law, min_r2: float = 0.9) -> RankCostModel:
    """The router's model with the kernel-latency law of Toppings (ATC'25; ``law`` a
    :class:`~impl.caraserve.kernel_law.KernelLaw`): T_dec = (a0 + a1 B + a3 sum ctx, fitted on the
    base model's decode step ``base_dec_time``) + (alpha x law feature + beta, the fitted law), so
    ``a2 = alpha`` and ``a0`` absorbs ``beta``; the prefill form as :func:`fit`. The decode R^2 is
    of the composed model against the full step ``dec_time`` on the same samples."""
    Xb = np.array([[1.0, float(len(r)), float(sum(c))] for c, r in dec_samples])
    yb = np.array([base_dec_time(c, r) for c, r in dec_samples])
    cb, _ = nnls_fit(Xb, yb)
    coef = [float(cb[0] + law.beta_s), float(cb[1]), float(law.alpha_s), float(cb[2])]
    Xd = np.array([features_dec(c, r, law.kernel) for c, r in dec_samples])
    yd = np.array([dec_time(c, r) for c, r in dec_samples])
    pred = Xd @ np.asarray(coef)
    ss_tot = float(((yd - yd.mean()) ** 2).sum())
    r2d = 1.0 - float(((yd - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    Xp = np.array([features_pre(l, r) for l, r in pre_samples])
    yp = np.array([pre_time(l, r) for l, r in pre_samples])
    cp, r2p = nnls_fit(Xp, yp)
    return RankCostModel(kernel=law.kernel, dec_coef=coef, pre_coef=[float(x) for x in cp], dec_r2=r2d, pre_r2=r2p,
                         min_r2=min_r2, samples=len(dec_samples) + len(pre_samples))
