"""ADAPTRA's delay-aware schedule: Alg. 2's warm-up quotas run through the Alg. 3/4 list scheduler.

The list scheduler itself is shared with the ZB baseline and lives in
:mod:`impl.common.schedule.list_scheduler`; what is ADAPTRA's own is the quota rule
(:mod:`impl.adaptra.adapt`).
"""
from __future__ import annotations

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
