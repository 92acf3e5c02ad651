"""Per-link delay tables for the pipeline simulator (``impl.common.fault_model.link_delay`` computes them from a fault)."""
from __future__ import annotations

from typing import Mapping, Optional

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
