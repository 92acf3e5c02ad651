"""Time of one packed micro-batch as a function of its sequence length: ``T(s) = a·s² + b·s + c``
(HotSPa's strategy planning [R] and the cost models of Hydraulis's and LobRA's authors' code use
this form: attention is quadratic in s, the matrix work linear, launch and fixed overheads
constant). One object per (model, strategy), fitted by least squares from timed micro-batches (real
mode) or derived from FLOPs (sim); the same object feeds the planners and the simulator."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from impl.common.api import ConfigError

MIN_R2 = 0.9


@dataclass(frozen=True)
class SeqCost:
    a: float  # s / token²
    b: float  # s / token
    c: float  # s
    r2: float = 1.0  # of the fit that produced it (1.0 when derived analytically)
    source: str = "analytic"  # "fit" | "analytic" | "published"

    def time_s(self, s: float) -> float:
        return self.a * s * s + self.b * s + self.c

    def packed_time_s(self, lengths: Sequence[int]) -> float:
        """A packed row of segments: attention is per segment (Σ s²), the rest is per token."""
        ls = [int(x) for x in lengths]
        return self.a * sum(x * x for x in ls) + self.b * sum(ls) + self.c


def fit_seq_cost(lengths: Sequence[float], times_s: Sequence[float], *, min_r2: float = MIN_R2,
                 sq_lengths: Sequence[float] | None = None, field: str = "cost fit") -> SeqCost:
    """Least squares over timed micro-batches. ``sq_lengths`` is Σ s² per sample for packed rows
    (defaults to s², one sequence per sample). Refuses fewer than 3 distinct lengths and a fit
    whose R² is below ``min_r2``."""
    s = np.asarray(lengths, dtype=float)
    t = np.asarray(times_s, dtype=float)
    sq = s * s if sq_lengths is None else np.asarray(sq_lengths, dtype=float)
    if not (len(s) == len(t) == len(sq)):
        raise ConfigError(f"{field}: {len(s)} lengths, {len(sq)} squared lengths and {len(t)} times differ in count")
    if len(np.unique(s)) < 3:
        raise ConfigError(f"{field}: need timings at >= 3 distinct lengths, got {len(np.unique(s))}")
    X = np.stack([sq, s, np.ones_like(s)], axis=1)
    coef, *_ = np.linalg.lstsq(X, t, rcond=None)
    pred = X @ coef
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    if r2 < min_r2:
        raise ConfigError(f"{field}: R² {r2:.3f} of a·s²+b·s+c over {len(s)} timings is below {min_r2}")
    a, b, c = (float(x) for x in coef)
    return SeqCost(a=a, b=b, c=c, r2=r2, source="fit")
