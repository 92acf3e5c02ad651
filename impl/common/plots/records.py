"""Which records a figure draws."""
from __future__ import annotations

from typing import Iterable


def plottable(records: Iterable[dict], metric: str, with_invalid: bool = False) -> list[dict]:
    """Records that finished ``ok`` (and ``invalid`` ones too when ``with_invalid``, for a figure
    that draws them flagged) and report ``metric``."""
    keep = ("ok", "invalid") if with_invalid else ("ok",)
    return [r for r in records if r.get("status") in keep and metric in (r.get("metrics") or {})]


def mode_style(records: Iterable[dict]) -> dict:
    """How a figure marks what its values are, the same on every figure: measured values solid
    (lines ``-``, plain bars), simulated ones dashed / hatched; ``word`` names it for a label."""
    modes = {r.get("mode") for r in records}
    if modes == {"real"}:
        return {"word": "measured", "linestyle": "-", "hatch": None}
    if modes == {"sim"}:
        return {"word": "simulated", "linestyle": "--", "hatch": "//"}
    return {"word": "sim+real", "linestyle": "-.", "hatch": ".."}


def mode_legend_entry(ax, records: Iterable[dict], kind: str = "bar") -> None:
    """A legend entry saying how this figure's values are marked (call before ``ax.legend``)."""
    style = mode_style(records)
    if kind == "bar":
        # An empty polygon: a legend patch of its own style that draws nothing and moves no limit.
        ax.fill([], [], facecolor="white", edgecolor="0.4", hatch=style["hatch"], label=f"{style['word']} values")
    else:
        ax.plot([], [], color="0.4", linestyle=style["linestyle"], label=f"{style['word']} values")
