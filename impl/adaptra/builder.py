"""ADAPTRA's delay-aware schedule: Alg. 2's warm-up quotas run through the Alg. 3/4 list scheduler.

The list scheduler itself is shared with the ZB baseline and lives in
:mod:`impl.common.schedule.list_scheduler`; what is ADAPTRA's own is the quota rule
(:mod:`impl.adaptra.adapt`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from impl.adaptra.adapt import adapt_warmup
from impl.common.schedule.ir import Schedule
from impl.common.schedule.list_scheduler import build_schedule


def adaptra_schedule(tF: Sequence[float], tB: Sequence[float], tW: Sequence[float], c: Sequence[float],
                     num_microbatches: int, formula: str = "paper", **build_kw) -> tuple[Schedule, list[int]]:
    """Alg. 2 then Alg. 3/4: the delay-aware schedule and the warm-up quotas it was built from.

    ``formula`` picks Alg. 2's slack rule (``adapt.FORMULAS``); callers should log it.
    """
    warmup = adapt_warmup(tF, tB, c, num_microbatches, formula=formula)
    return build_schedule(tF, tB, tW, c, warmup, num_microbatches=num_microbatches, **build_kw), warmup


@dataclass
class AdaptraPlanner:
    """Picklable schedule provider: Alg. 2 + Alg. 3/4 for the delays the scheduler sees."""

    t_op_s: float
    num_stages: int
    num_microbatches: int
    formula: str
    steps_per_op: int

    def __call__(self, iteration: int, delays: dict) -> Schedule:
        S, t = self.num_stages, self.t_op_s
        c = [float(delays.get((i, i + 1), 0.0)) for i in range(S - 1)]
        sched, _ = adaptra_schedule([t] * S, [t] * S, [t] * S, c, self.num_microbatches, formula=self.formula,
                                    steps_per_op=self.steps_per_op)
        return sched
