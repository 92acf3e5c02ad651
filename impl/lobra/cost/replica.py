"""LobRA's cost model (the authors' code, Hetu `examples/lobra`; paper App. D): per scheme (tp, pp), one layer's time for ``mbs`` sequences
padded to ``s``::

    f(mbs, s) = (c1·mbs + c2)·s² + (c3·mbs + c4)·s + (c5·mbs + c6)

fitted by least squares from timed micro-batches (real mode) or derived from FLOPs, the TP
collectives and the Table-3 per-GPU throughputs (sim, :mod:`impl.lobra.cost.step_model`). A micro-batch
on a stage takes ``t(mbs, s) = f(mbs, s)·L/pp``; f is linear in mbs, so ``t(r, s) = α(s)·r + β(s)``
(the dispatcher's ILP relies on it). A replica's step is ``Σ_micro-batches t + (pp−1)·max t``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from impl.common.api import ConfigError

MIN_R2 = 0.9


@dataclass(frozen=True)
class TpCost:
    """The six coefficients of f (seconds per layer); ``source`` says where they came from."""

    c: tuple[float, float, float, float, float, float]
    r2: float = 1.0
    source: str = "analytic"

    def f(self, mbs: float, s: float) -> float:
        c1, c2, c3, c4, c5, c6 = self.c
        return (c1 * mbs + c2) * s * s + (c3 * mbs + c4) * s + (c5 * mbs + c6)

    def per_seq(self, s: float) -> float:
        """∂f/∂mbs at s: the cost of one more sequence."""
        c1, _, c3, _, c5, _ = self.c
        return c1 * s * s + c3 * s + c5

    def fixed(self, s: float) -> float:
        """f(0, s): the part of a micro-batch's time that does not grow with mbs."""
        _, c2, _, c4, _, c6 = self.c
        return c2 * s * s + c4 * s + c6


def fit_tp_cost(samples: Sequence[tuple[int, int, float]], *, min_r2: float = MIN_R2,
                field: str = "cost fit") -> TpCost:
    """Least squares of f over ``(mbs, s, seconds per layer)`` samples. Needs >= 2 distinct mbs
    and >= 3 distinct s (else the six terms are not identifiable); refuses R² < ``min_r2``."""
    arr = np.asarray(samples, dtype=float)
    if arr.ndim != 2 or arr.shape[1] != 3 or len(arr) < 6:
        raise ConfigError(f"{field}: need >= 6 (mbs, s, time) samples, got {len(arr)}")
    mbs, s, t = arr[:, 0], arr[:, 1], arr[:, 2]
    if len(np.unique(mbs)) < 2 or len(np.unique(s)) < 3:
        raise ConfigError(f"{field}: need >= 2 distinct mbs and >= 3 distinct s, got {len(np.unique(mbs))} and "
                          f"{len(np.unique(s))}")
    X = np.stack([mbs * s * s, s * s, mbs * s, s, mbs, np.ones_like(s)], axis=1)
    coef, *_ = np.linalg.lstsq(X, t, rcond=None)
    pred = X @ coef
    ss_res, ss_tot = float(np.sum((t - pred) ** 2)), float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    if r2 < min_r2:
        raise ConfigError(f"{field}: R² {r2:.3f} of f(mbs, s) over {len(t)} timings is below {min_r2}")
    return TpCost(tuple(float(x) for x in coef), r2=r2, source="fit")


@dataclass(frozen=True)
class Scheme:
    """One replica configuration: (tp, pp), the most tokens a micro-batch may hold, and f."""

    tp: int
    pp: int
    max_tokens: int
    cost: TpCost
    num_layers: int
    name: str = ""

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.max_tokens, self.num_layers) < 1:
            raise ConfigError(f"scheme tp{self.tp}pp{self.pp}: tp, pp, max_tokens, num_layers must be >= 1")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def label(self) -> str:
        return self.name or (f"TP{self.tp}" + (f"PP{self.pp}" if self.pp > 1 else "") + f"({self.max_tokens})")

    def mbs(self, s: int) -> int:
        """Sequences of bucket length s per full micro-batch (0: s does not fit)."""
        return self.max_tokens // int(s)

    def t(self, mbs: float, s: float) -> float:
        """One micro-batch on one stage."""
        if mbs <= 0:
            return 0.0
        return self.cost.f(mbs, s) * self.num_layers / self.pp

    def alpha(self, s: float) -> float:
        return self.cost.per_seq(s) * self.num_layers / self.pp

    def beta(self, s: float) -> float:
        return self.cost.fixed(s) * self.num_layers / self.pp

    def throughput_per_gpu(self, m: int = 16) -> float:
        """The authors' per-GPU throughput: max_tokens·m / (latency·tp·pp), latency of m full micro-batches of one
        max_tokens-long sequence under the (m + pp − 1) pipeline shortcut."""
        lat = self.t(1, self.max_tokens) * (m + self.pp - 1)
        return self.max_tokens * m / (lat * self.gpus)


def replica_time(scheme: Scheme, micro_batches: Sequence[tuple[int, int]]) -> float:
    """``Σ t + (pp−1)·max t`` over ``(mbs, s)`` micro-batches."""
    ts = [scheme.t(n, s) for n, s in micro_batches if n > 0]
    if not ts:
        return 0.0
    return sum(ts) + (scheme.pp - 1) * max(ts)


def pow2_ceil(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, int(x)))))
