"""Per-link delay tables for the pipeline simulator, from a ``faults.spec.LinkDelay``."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from impl.common.api import ConfigError

Link = tuple[int, int]


def normalize_delays(delays: Optional[Mapping], stages: int) -> dict[Link, float]:
    """Check a ``{(i, i+1): seconds}`` table (lists accepted as keys, as YAML gives them)."""
    out: dict[Link, float] = {}
    for key, value in (delays or {}).items():
        i, j = (int(x) for x in key)
        if j != i + 1 or not 0 <= i < stages - 1:
            raise ConfigError(f"delays: link {tuple(key)} is not a pipeline link (i, i+1) with 0 <= i < {stages - 1}")
        if not value >= 0.0:
            raise ConfigError(f"delays: link ({i}, {j}) delay must be >= 0 seconds, got {value}")
        out[(i, j)] = out.get((i, j), 0.0) + float(value)
    return out


def link_delays_at(fault, iteration: int) -> dict[Link, float]:
    """Delay table in force at ``iteration`` for a LinkDelay fault (empty when none applies).

    A non-empty ``trace`` replaces links/delay_s: the last event with start_iter <= iteration
    holds until the next one. ``start_iter``/``stop_iter`` (exclusive) bound the whole fault.
    """
    if getattr(fault, "kind", None) != "link_delay":
        return {}
    if iteration < fault.start_iter or (fault.stop_iter is not None and iteration >= fault.stop_iter):
        return {}
    links: Sequence = fault.links
    delay_s = fault.delay_s
    if fault.trace:
        current = [ev for ev in fault.trace if ev.start_iter <= iteration]
        if not current:
            return {}
        last = max(current, key=lambda ev: ev.start_iter)
        links, delay_s = last.links, last.delay_s
    # Links are undirected (spec writes "6↔7"): accept either order.
    return {tuple(sorted((int(a), int(b)))): float(delay_s) for a, b in links} if delay_s > 0 else {}
