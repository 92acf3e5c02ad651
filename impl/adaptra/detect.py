"""Change-point detection on iteration times: Falcon's detector (Falcon, arXiv 2410.12588), which
ADAPTRA reuses in measured mode (the paper uses Falcon's detector).

:class:`BOCPD` is Bayesian online change-point detection (Adams & MacKay 2007) on log
iteration time: Normal observations with unknown mean and variance, Normal-Gamma prior,
constant hazard. :class:`ChangeDetector` declares a change once the run-length posterior puts
>= ``threshold`` (Falcon: 0.9) on runs that started within the last ``window`` observations
and hold at least ``min_after`` of them, and keeps it only if the before/after mean iteration
times differ by >= ``min_rel_change`` (Falcon: 10%). After a kept change it restarts from the
change point, so the next change (e.g. a mitigation taking effect) is found too.

Why not a PyPI package: the BOCPD packages there (bayesian-changepoint-detection 0.2.dev1 from
2019, bocd 0.1.2, bocpd 0.0.4) are unmaintained pre-1.0 releases; the algorithm is 30 lines of
numpy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy.special import gammaln

from impl.common.api import ConfigError

# Falcon's detector settings: threshold 0.9 and 10% are Falcon's; hazard and window are ours
# [R] (impl/adaptra/README.md, "Sim-mode scenario models", Detection).
HAZARD = 0.01
THRESHOLD = 0.9
MIN_REL_CHANGE = 0.10
WINDOW = 10


class BOCPD:
    """Run-length posterior ``R[r]`` = P(the current run holds the last r observations)."""

    def __init__(self, hazard: float = HAZARD, mu0: float = 0.0, kappa0: float = 0.01, alpha0: float = 1.0,
                 beta0: float = 0.05 ** 2):
        if not 0 < hazard < 1:
            raise ConfigError(f"BOCPD hazard must be in (0, 1), got {hazard}")
        self.h = hazard
        self.prior = (mu0, kappa0, alpha0, beta0)
        self.R = np.ones(1)
        self.mu, self.kappa = np.array([mu0]), np.array([kappa0])
        self.alpha, self.beta = np.array([alpha0]), np.array([beta0])

    def _log_pred(self, x: float) -> np.ndarray:
        """Student-t predictive of x under each run length's posterior."""
        df = 2 * self.alpha
        scale2 = self.beta * (self.kappa + 1) / (self.alpha * self.kappa)
        z = (x - self.mu) ** 2 / (df * scale2)
        return (gammaln((df + 1) / 2) - gammaln(df / 2) - 0.5 * np.log(math.pi * df * scale2)
                - (df + 1) / 2 * np.log1p(z))

    def update(self, x: float) -> np.ndarray:
        logp = self._log_pred(x)
        p = self.R * np.exp(logp - logp.max())
        growth = p * (1 - self.h)
        R = np.concatenate(([p.sum() * self.h], growth))
        self.R = R / R.sum()
        mu0, k0, a0, b0 = self.prior
        beta = self.beta + self.kappa * (x - self.mu) ** 2 / (2 * (self.kappa + 1))
        self.mu = np.concatenate(([mu0], (self.kappa * self.mu + x) / (self.kappa + 1)))
        self.kappa = np.concatenate(([k0], self.kappa + 1))
        self.alpha = np.concatenate(([a0], self.alpha + 0.5))
        self.beta = np.concatenate(([b0], beta))
        return self.R


@dataclass(frozen=True)
class Change:
    at: int  # index of the first observation of the new regime
    detected_at: int  # index of the observation that confirmed it
    before_mean: float
    after_mean: float

    @property
    def rel_change(self) -> float:
        return self.after_mean / self.before_mean - 1.0


class ChangeDetector:
    """Online change points of a positive series (iteration times), Falcon's rule."""

    def __init__(self, hazard: float = HAZARD, threshold: float = THRESHOLD, min_rel_change: float = MIN_REL_CHANGE,
                 window: int = WINDOW, min_after: int = 2, min_before: int = 2):
        if not 0 < threshold <= 1:
            raise ConfigError(f"change-point threshold must be in (0, 1], got {threshold}")
        if min_rel_change < 0:
            raise ConfigError(f"min_rel_change must be >= 0, got {min_rel_change}")
        self.hazard, self.threshold, self.min_rel = hazard, threshold, min_rel_change
        self.window, self.min_after, self.min_before = window, min_after, min_before
        self.series: list[float] = []
        self.start = 0  # first index of the current regime
        self.changes: list[Change] = []
        self._reset(0)

    def _reset(self, start: int) -> None:
        self.start = start
        self._bocpd = BOCPD(self.hazard)
        for x in self.series[start:]:
            self._bocpd.update(math.log(x))

    def update(self, x: float) -> Optional[Change]:
        if not x > 0:
            raise ConfigError(f"change detection needs positive observations, got {x}")
        self.series.append(x)
        R = self._bocpd.update(math.log(x))
        n = len(self.series) - self.start  # observations in this regime so far
        hi = min(self.window, n - self.min_before)
        if hi < self.min_after:
            return None
        mass = R[self.min_after:hi + 1]
        if mass.sum() < self.threshold:
            return None
        r = self.min_after + int(np.argmax(mass))
        tau = len(self.series) - r
        before = self.series[self.start:tau]
        after = self.series[tau:]
        b, a = sum(before) / len(before), sum(after) / len(after)
        if abs(a / b - 1.0) < self.min_rel:
            return None
        change = Change(at=tau, detected_at=len(self.series) - 1, before_mean=b, after_mean=a)
        self.changes.append(change)
        self._reset(tau)
        return change


def detect_changes(series, **kw) -> list[Change]:
    """Every change :class:`ChangeDetector` keeps over a whole series (offline helper)."""
    det = ChangeDetector(**kw)
    for x in series:
        det.update(x)
    return det.changes
