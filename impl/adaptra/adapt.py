"""Alg. 2: widen the slack at slow links so a delay stops cascading.

A link delay ``c_i`` only costs ``Θ(c_i)`` while ``tF_i + tB_i + 2c_i ≤ Δ_i·(tF_{i+1} +
tB_{i+1})`` (the paper's no-cascade condition); past it every micro-batch adds a bubble. Alg. 2 sets each slack to the
smallest value meeting that condition, walking from the last stage (``x_{S−1} = 1``) up.

Two formulas, because the paper's Alg. 2 and the authors' code differ; log which one ran:

* ``"paper"``: ``Δ_i = min(N − 2S, max(⌈(tF_i+tB_i+2c_i)/(tF_{i+1}+tB_{i+1})⌉, 2))``.
* ``"artifact"``: ``Δ_i = ⌈c_i / tF_i⌉ + 2``, unclipped.

Choices of ours [R]:
* ``N − 2S`` is below 2 whenever ``N < 2S + 2`` (e.g. N = 8 at S = 4), and the paper's
  formula would then give slack < 2 or even negative quotas. We apply the ``N − 2S`` cap first
  and then floor the slack at 2, i.e. ``Δ_i = max(2, min(N−2S, need))``: Δ ≥ 2 always holds
  before the clip to N below.
* Every ``x_i`` is then clipped to N (both formulas): a quota above N makes a stage wait for
  forwards that never come. After clipping, neighbouring quotas may be equal (slack 0) — the
  stage simply stores every micro-batch; x stays non-increasing.
* Ceilings use a 1e-9 tolerance so that e.g. 0.06/0.02 = 2.9999999999999996 still gives 3 and
  2.0000000000000004 gives 2.
"""
from __future__ import annotations

import math
from typing import Sequence

from impl.common.api import ConfigError

FORMULAS = ("paper", "artifact")
_EPS = 1e-9


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def _check(name: str, v: Sequence[float], n: int, positive: bool) -> None:
    if len(v) != n:
        raise ConfigError(f"{name} has {len(v)} entries, expected {n}")
    for i, t in enumerate(v):
        ok = (t > 0 if positive else t >= 0) and math.isfinite(t)
        if not ok:
            raise ConfigError(f"{name}[{i}] = {t} must be finite and {'> 0' if positive else '>= 0'}")


def slack(tF: Sequence[float], tB: Sequence[float], c: Sequence[float], i: int, num_microbatches: int,
          formula: str = "paper") -> int:
    """Slack Δ_i for link (i, i+1) before the final clip of x to N (always ≥ 2)."""
    S, N = len(tF), num_microbatches
    if formula == "paper":
        need = max(_ceil((tF[i] + tB[i] + 2 * c[i]) / (tF[i + 1] + tB[i + 1])), 2)
        return max(2, min(N - 2 * S, need))
    if formula == "artifact":
        return _ceil(c[i] / tF[i]) + 2
    raise ConfigError(f"formula {formula!r} is unknown; choose one of {list(FORMULAS)}")


def adapt_warmup(tF: Sequence[float], tB: Sequence[float], c: Sequence[float], num_microbatches: int,
                 formula: str = "paper") -> list[int]:
    """Warm-up quotas ``x_0..x_{S−1}`` for measured op times (s) and per-link added latency (s)."""
    if formula not in FORMULAS:
        raise ConfigError(f"formula {formula!r} is unknown; choose one of {list(FORMULAS)}")
    S, N = len(tF), num_microbatches
    if S < 1:
        raise ConfigError("tF is empty: need one forward time per stage (num_stages >= 1)")
    if not isinstance(N, int) or N < 1:
        raise ConfigError(f"num_microbatches must be an integer >= 1, got {N!r}")
    _check("tF", tF, S, True)
    _check("tB", tB, S, True)
    _check("c", c, S - 1, False)
    x = [0] * S
    x[S - 1] = 1
    for i in range(S - 2, -1, -1):
        x[i] = min(N, x[i + 1] + slack(tF, tB, c, i, N, formula))
    return x
