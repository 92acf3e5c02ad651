"""Which records a figure draws."""
from __future__ import annotations

from typing import Iterable


def plottable(records: Iterable[dict], metric: str, with_invalid: bool = False) -> list[dict]:
    """Records that finished ``ok`` (and ``invalid`` ones too when ``with_invalid``, for a figure
    that draws them flagged) and report ``metric``."""
    keep = ("ok", "invalid") if with_invalid else ("ok",)
    return [r for r in records if r.get("status") in keep and metric in (r.get("metrics") or {})]
