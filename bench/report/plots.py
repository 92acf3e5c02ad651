"""The report's own figure: each paper number beside ours, drawn so that it says what it shows.

Marker code, the same on every figure of the report (and in its legend): the paper's value is a
black dash (a band is a grey bar between its ends); ours is a filled circle when measured, a
hollow square when simulated. One panel per unit, the unit on its y axis.
"""
from __future__ import annotations

import pathlib
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from impl.common.plots.save import save_png  # noqa: E402

OURS_STYLE = {
    "real": dict(marker="o", color="tab:blue", markerfacecolor="tab:blue", linestyle="none", markersize=7),
    "sim": dict(marker="s", color="tab:orange", markerfacecolor="none", markeredgewidth=1.6, linestyle="none",
                markersize=7),
}
OURS_LABEL = {"real": "ours, measured", "sim": "ours, simulated"}
UNIT_LABEL = {"x": "times better (x)", "s": "seconds (s)", "min": "minutes (min)", "ms": "milliseconds (ms)",
              "fraction": "fraction (0-1)"}


def legend_handles(modes: Sequence[str], band: bool = True) -> list[Line2D]:
    handles = [Line2D([], [], color="k", marker="|", markersize=14, markeredgewidth=2.5, linestyle="none",
                      label="paper (or our target)")]
    if band:
        handles.append(Line2D([], [], color="0.75", linewidth=6, label="paper band"))
    for mode in ("real", "sim"):
        if mode in modes:
            handles.append(Line2D([], [], label=OURS_LABEL[mode], **OURS_STYLE[mode]))
    return handles


def paper_vs_ours(rows: Sequence[dict], path: pathlib.Path, title: str) -> pathlib.Path:
    """``rows``: dicts with ``label``, ``unit``, ``paper`` (value), ``high`` (band end or None),
    ``ours`` (value or None) and ``mode`` (sim | real | None)."""
    units = list(dict.fromkeys(r["unit"] for r in rows))
    counts = [sum(r["unit"] == u for r in rows) for u in units]
    fig, axes = plt.subplots(len(units), 1, figsize=(8.5, sum(max(1.7, 0.9 + 0.28 * n) for n in counts) + 0.5),
                             squeeze=False, gridspec_kw={"height_ratios": [max(2, n) for n in counts]})
    modes = set()
    for ax, unit in zip(axes[:, 0], units):
        mine = [r for r in rows if r["unit"] == unit]
        ys = list(range(len(mine)))[::-1]
        for y, r in zip(ys, mine):
            if r["high"] is not None:
                ax.plot([r["paper"], r["high"]], [y, y], color="0.75", linewidth=6, solid_capstyle="butt", zorder=1)
            else:
                ax.plot([r["paper"]], [y], color="k", marker="|", markersize=14, markeredgewidth=2.5, zorder=2)
            if r["ours"] is not None:
                mode = "real" if r["mode"] == "real" else "sim"
                modes.add(mode)
                ax.plot([r["ours"]], [y], zorder=3, **OURS_STYLE[mode])
        ax.set_yticks(ys)
        ax.set_yticklabels([r["label"] for r in mine], fontsize=7)
        ax.margins(x=0.06)
        ax.set_ylim(-0.7, len(mine) - 0.3)
        ax.set_xlabel(UNIT_LABEL.get(unit, unit), fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        lo = min([r["paper"] for r in mine] + [r["ours"] for r in mine if r["ours"] is not None])
        if lo >= 0:
            ax.set_xlim(left=0)
    fig.suptitle(title, fontsize=9)
    # Above the panels, so it never hides a marker.
    axes[0, 0].legend(handles=legend_handles(sorted(modes), any(r["high"] is not None for r in rows)), fontsize=7, loc="lower left",
                      bbox_to_anchor=(0.0, 1.0), ncol=4, frameon=False)
    return save_png(fig, path, dpi=90)
