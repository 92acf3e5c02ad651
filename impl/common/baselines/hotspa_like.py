"""HotSPa-like bucketed hot switching (HotSPa 2.7 offline planning), as HotSPa's own planner
(``grouping: planned``) and Hydraulis' ``hotspa_like`` baseline run it: the sequences of a step
fall into length groups between boundaries; each group runs the strategy fastest on its share of
the planning steps; of the boundary sets tried (merges of the candidate boundaries), the one with
the smallest mean step wins and is fixed for the run. Strategies and step prices come from the
paper's cost model (handed in as ``choose`` and ``mean_step``).

The papers enumerate differently, hence :class:`BucketSearch`'s knobs: Hydraulis tries every merge
(``max_groups`` 0) in bit-mask order and keeps a strictly faster one; HotSPa's planner tries up to
``plan_max_groups`` groups, fewest cuts first, and keeps one faster by more than 1e-12 s.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Sequence

from impl.common.errors import ConfigError

ORDERS = ("mask", "size")


def halving_boundaries(context: int, given: Sequence[int], floor: int = 2048,
                       field: str = "system.sim.hotspa_boundaries") -> list[int]:
    """``given`` (descending, the first >= context), or the context halved down to ``floor``;
    with the closing 0."""
    b = list(given)
    if not b:
        b, x = [], context
        while x >= floor:
            b.append(x)
            x //= 2
    if sorted(b, reverse=True) != b or b[0] < context:
        raise ConfigError(f"{field}: {b} must be descending with the first >= workload.context {context}")
    return b + [0]


@dataclass(frozen=True)
class BucketSearch:
    max_groups: int = 0  # 0: every merge
    order: str = "mask"  # mask: bit-mask order over the inner boundaries; size: fewest cuts first
    tolerance_s: float = 0.0  # a later merge wins only when faster by more than this

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ConfigError(f"system.sim.bucket_order: unknown {self.order!r} (one of: {', '.join(ORDERS)})")
        if self.max_groups < 0:
            raise ConfigError(f"system.sim.plan_max_groups: must be >= 0 (0 = every merge), got {self.max_groups}")
        if self.tolerance_s < 0:
            raise ConfigError(f"system.sim.bucket_tolerance_s: must be >= 0, got {self.tolerance_s}")

    def merges(self, top: int, inner: Sequence[int]) -> Iterator[list[int]]:
        """Boundary sets ``[top, *cuts, 0]`` with cuts from ``inner`` (descending)."""
        if self.order == "mask":
            for mask in range(2 ** len(inner)):
                cuts = [x for i, x in enumerate(inner) if mask >> i & 1]
                if not self.max_groups or len(cuts) < self.max_groups:
                    yield [top, *cuts, 0]
            return
        for k in range(self.max_groups or len(inner) + 1):
            for cut in itertools.combinations(inner, k):
                yield [top, *cut, 0]

    def search(self, top: int, inner: Sequence[int], choose: Callable[[int, int], Hashable],
               mean_step: Callable[[list, list], float]) -> tuple[float, list, list, int]:
        """(mean step, boundaries, strategy per group, merges tried): ``choose(lo, hi)`` is the
        group's strategy (asked once per range), ``mean_step(boundaries, strategies)`` the
        merge's mean step over the planning steps."""
        chosen: dict = {}

        def pick(lo: int, hi: int):
            if (lo, hi) not in chosen:
                chosen[(lo, hi)] = choose(lo, hi)
            return chosen[(lo, hi)]

        best, tried = None, 0
        for b in self.merges(top, inner):
            strat = [pick(lo, hi) for hi, lo in zip(b, b[1:])]
            t = mean_step(b, strat)
            tried += 1
            if best is None or t < best[0] - self.tolerance_s:
                best = (t, b, strat)
        return best[0], best[1], best[2], tried
