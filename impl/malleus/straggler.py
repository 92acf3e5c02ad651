"""Straggler quantification and re-plan triggers, after the authors' code (PKU-DAIR/Hetu
`python/hetu/engine/straggler.py`, `strategy.py`).

- Active GPU g: x_g = (T_g / (l * m * alpha_k)) / t_ref, T_g its compute-only time in an
  iteration (no communication waits), l its layers, m its pipeline's micro-batches, alpha_k
  its TP-shrink slowdown; averaged over the last ``window`` iterations. t_ref is the healthy
  per-layer per-micro-batch time: given (sim: the cost model) or, in real mode, the lower
  median over active GPUs of their per-unit time in the first window (reconstruction: the
  reference run of a healthy uniform layout is not available once a straggler exists).
- Suspended GPU g: x_g = probe time / its startup baseline (mean of rounds 2-5 of 5).
- Hysteresis: rates under 1.2 count as 1; a re-plan is due when an active GPU's (effective)
  rate moved >= 0.3 from the plan's snapshot, or a suspended GPU fell under 1.2 (suspended
  GPUs >= 1.2 count as identical). Checked every ``check_every`` iterations.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from impl.common.parallel.plan import HEALTHY_BELOW, effective_rate


def probe_baseline(times_s: Sequence[float]) -> float:
    """Startup baseline of the GEMM probe: mean of rounds 2-5 of 5 (round 1 warms up)."""
    vals = list(times_s)[1:5] or list(times_s)
    return statistics.fmean(vals)


@dataclass
class StragglerMonitor:
    num_gpus: int
    window: int = 2
    check_every: int = 3
    replan_delta: float = 0.3
    healthy_below: float = HEALTHY_BELOW
    t_ref_s: Optional[float] = None  # healthy per-layer per-micro-batch time
    _hist: dict = field(default_factory=dict)  # gpu -> deque of per-unit rates
    _probe_base: dict = field(default_factory=dict)

    def observe_active(self, gpu: int, compute_s: float, layers: int, micro_batches: int, alpha_k: float) -> None:
        unit = compute_s / (layers * micro_batches * alpha_k)
        self._hist.setdefault(gpu, deque(maxlen=self.window)).append(("unit", unit))

    def observe_suspended(self, gpu: int, probe_s: float, baseline_s: float) -> None:
        self._hist.setdefault(gpu, deque(maxlen=self.window)).append(("probe", probe_s / baseline_s))

    def calibrate(self) -> None:
        """Real mode: fix t_ref from the units seen so far (lower median over GPUs)."""
        units = sorted(statistics.fmean(v for k, v in h if k == "unit") for h in self._hist.values()
                       if any(k == "unit" for k, _ in h))
        if units and self.t_ref_s is None:
            self.t_ref_s = statistics.median_low(units)

    def rates(self, default: Optional[Sequence[float]] = None) -> list[float]:
        """Current x per GPU (window mean); GPUs never observed keep ``default`` (or 1)."""
        out = list(default) if default is not None else [1.0] * self.num_gpus
        for g, h in self._hist.items():
            if not h:
                continue
            vals = [v / self.t_ref_s if k == "unit" else v for k, v in h]
            out[g] = statistics.fmean(vals)
        return out

    def reset(self) -> None:
        """After a plan change: the window restarts (old measurements were under another layout)."""
        for h in self._hist.values():
            h.clear()

    def ready(self) -> bool:
        return bool(self._hist) and all(len(h) >= self.window for h in self._hist.values())

    def replan_due(self, x: Sequence[float], snapshot: Sequence[float], suspended: Sequence[int]) -> bool:
        sus = set(suspended)
        for g in range(self.num_gpus):
            if g in sus:
                if x[g] < self.healthy_below:
                    return True
                continue
            a = effective_rate(x[g], self.healthy_below)
            b = effective_rate(snapshot[g], self.healthy_below)
            if abs(a - b) >= self.replan_delta - 1e-12:
                return True
        return False

    def cache_key(self, x: Sequence[float], suspended: Sequence[int]) -> tuple:
        """Rates that select the same plan: effective rates to 0.1; suspended stragglers identical."""
        sus = set(suspended)
        out = []
        for g, v in enumerate(x):
            e = effective_rate(v, self.healthy_below)
            out.append(-1.0 if (g in sus and e > 1.0) else round(e, 1))
        return tuple(out)
