"""Time-varying pipeline-link delays (ADAPTRA's sim scenario S6, `impl/adaptra/README.md`,
"Sim-mode scenario models"): a seeded, piecewise-constant timeline in seconds that the
simulator queries per message (``DelayTimeline.delay``) and the scheduler queries at iteration
boundaries (``table_at``, ``mean_over``). Sim only.

The timeline is drawn lazily in time order from one ``random.Random(seed)``, so it does not
depend on which times are queried: every segment draws its length from U(interval_s), then
``links_per_change`` distinct links from the candidates, then one delay per link.
"""
from __future__ import annotations

import bisect
import random

from impl.common.fault_model.link_delay import Link, check_links, resolve_link
from impl.common.api import ConfigError


def _pair(value, name: str) -> tuple[float, float]:
    vals = list(value)
    if len(vals) != 2 or not vals[0] <= vals[1]:
        raise ConfigError(f"{name} must be a range [low, high] with low <= high, got {vals}")
    return float(vals[0]), float(vals[1])


def validate_varying_link_delay(fault, stages: int) -> None:
    if getattr(fault, "kind", None) != "varying_link_delay":
        return
    if stages < 2:
        raise ConfigError(f"fault.kind varying_link_delay: a {stages}-stage pipeline has no link")
    check_links(fault.links, stages, "fault.links")
    lo, _ = _pair(fault.interval_s, "fault.interval_s")
    if lo <= 0:
        raise ConfigError(f"fault.interval_s must be > 0 seconds, got {list(fault.interval_s)}")
    dlo, _ = _pair(fault.delay_s, "fault.delay_s")
    if dlo < 0:
        raise ConfigError(f"fault.delay_s must be >= 0 seconds, got {list(fault.delay_s)}")
    if fault.delay_step_s < 0:
        raise ConfigError(f"fault.delay_step_s must be >= 0 seconds (0 = continuous), got {fault.delay_step_s}")
    n = len(candidate_links(fault, stages))
    if not 0 <= fault.links_per_change <= n:
        raise ConfigError(f"fault.links_per_change must be in 0..{n} (0 = every candidate link), got {fault.links_per_change}")
    if fault.detection not in ("oracle", "measured"):
        raise ConfigError(f"fault.detection: unknown value {fault.detection!r} (one of: oracle, measured)")


def candidate_links(fault, stages: int) -> list[Link]:
    if fault.links:
        return sorted({resolve_link(link, stages) for link in fault.links})
    return [(i, i + 1) for i in range(stages - 1)]


class DelayTimeline:
    """Segments ``[starts[k], starts[k+1])`` each with a table ``{(i, i+1): seconds}``."""

    def __init__(self, fault, stages: int):
        validate_varying_link_delay(fault, stages)
        self._links = candidate_links(fault, stages)
        self._k = fault.links_per_change or len(self._links)
        self._interval = _pair(fault.interval_s, "fault.interval_s")
        self._delay = _pair(fault.delay_s, "fault.delay_s")
        self._step = float(fault.delay_step_s)
        self._rng = random.Random(int(fault.seed))
        self.starts: list[float] = []
        self.tables: list[dict[Link, float]] = []
        self._end = 0.0  # end of the last drawn segment
        self._draw()

    def _draw_delay(self) -> float:
        lo, hi = self._delay
        if self._step > 0:
            return round(lo + self._step * self._rng.randint(0, int(round((hi - lo) / self._step))), 9)
        return self._rng.uniform(lo, hi)

    def _draw(self) -> None:
        length = self._rng.uniform(*self._interval)
        links = sorted(self._rng.sample(self._links, self._k))
        table = {link: self._draw_delay() for link in links}
        self.starts.append(self._end)
        self.tables.append({k: v for k, v in table.items() if v > 0})
        self._end += length

    def _segment(self, t: float) -> int:
        while t >= self._end:
            self._draw()
        return max(bisect.bisect_right(self.starts, t) - 1, 0)

    def table_at(self, t: float) -> dict[Link, float]:
        return dict(self.tables[self._segment(t)])

    def delay(self, i: int, t: float) -> float:
        """The simulator's ``DelayFn``: delay of link (i, i+1) for a message sent at ``t``."""
        return self.tables[self._segment(t)].get((i, i + 1), 0.0)

    def mean_over(self, t0: float, t1: float) -> dict[Link, float]:
        """Each link's time-averaged delay over ``[t0, t1)`` (what per-link timers report)."""
        if t1 <= t0:
            return self.table_at(t0)
        self._segment(t1)
        acc: dict[Link, float] = {}
        k = self._segment(t0)
        while k < len(self.starts) and self.starts[k] < t1:
            end = self.starts[k + 1] if k + 1 < len(self.starts) else self._end
            w = min(end, t1) - max(self.starts[k], t0)
            for link, d in self.tables[k].items():
                acc[link] = acc.get(link, 0.0) + d * w
            k += 1
        return {link: v / (t1 - t0) for link, v in acc.items() if v > 0}

    def segments_until(self, t: float) -> list[tuple[float, dict[Link, float]]]:
        self._segment(t)
        return [(s, dict(tab)) for s, tab in zip(self.starts, self.tables) if s <= t]
