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


# The tornado chart of what a claim hinges on: each row splits in two so that the two ends of an
# input's range never share a label slot, even when both move the figure the same way; an input of
# one value (its other end is the composed one) keeps the whole row.
LOW_END = dict(color="tab:blue", label="figure at the low end of the input's range")
HIGH_END = dict(color="tab:red", label="figure at the high end")
ONE_VALUE = dict(color="tab:purple", label="figure at an input's one value (besides the composed one)")


def tornado(bars: Sequence[dict], path: pathlib.Path, title: str, *, base: float | None,
            band: tuple[float, float], band_label: str, base_text: str, unit: str, simulated: bool) -> pathlib.Path:
    """``bars`` (top row first): dicts with ``label``, ``figures`` (the figure at each swept value,
    None where no run), ``low``/``high`` (the figure at the range's low/high end, or None) and
    ``low_text``/``high_text`` (the input's value at each end). ``base``: the as-composed figure.
    A fraction is drawn in percent."""
    scale = 100.0 if unit == "fraction" else 1.0
    fig, ax = plt.subplots(figsize=(9.0, 1.6 + 0.55 * len(bars)))
    ax.axvspan(band[0] * scale, band[1] * scale, color="0.86", zorder=0)
    xs = [band[0] * scale, band[1] * scale] + ([base * scale] if base is not None else [])
    singles = False
    for y, b in zip(range(len(bars) - 1, -1, -1), bars):
        figs = [f * scale for f in b["figures"] if f is not None]
        if not figs:
            ax.text(base * scale if base is not None else band[0] * scale, y, "  no run", va="center", fontsize=7)
            continue
        ref = base * scale if base is not None else min(figs)
        # The swept values in between: a thin line over everything the input reaches.
        ax.plot([min(figs + [ref]), max(figs + [ref])], [y, y], color="0.35", linewidth=0.8, zorder=1)
        ax.plot(figs, [y] * len(figs), color="0.35", marker="|", markersize=7, linestyle="none", zorder=1)
        ends = (("low", 0.14, 0.26, LOW_END, b["low_text"]), ("high", -0.14, 0.26, HIGH_END, b["high_text"]))
        if len(b["figures"]) == 1:  # one value: its one end is both
            ends = (("low", 0.0, 0.54, ONE_VALUE, b["low_text"]),)
            singles = True
        for end, dy, height, style, text in ends:
            f = b[end]
            if f is None:
                ax.text(ref, y + dy, f"  {text}: no run", va="center", fontsize=6.5)
                continue
            f *= scale
            ax.barh(y + dy, f - ref, left=ref, height=height, color=style["color"], alpha=0.8, zorder=2)
            right = f >= ref
            ax.text(f, y + dy, f" {text} ", va="center", ha="left" if right else "right", fontsize=6.5, zorder=4)
        xs += figs
    if base is not None:
        ax.axvline(base * scale, color="k", linewidth=1.2, zorder=3)
    ax.set_yticks(range(len(bars) - 1, -1, -1))
    ax.set_yticklabels([b["label"] for b in bars], fontsize=7)
    ax.set_ylim(-0.7, len(bars) - 0.3)
    lo, hi = min(xs), max(xs)
    pad = 0.22 * (hi - lo or abs(hi) or 1.0)  # room for the end labels
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_xlabel("percent (%)" if unit == "fraction" else UNIT_LABEL.get(unit, unit), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    handles = [Line2D([], [], color="0.86", linewidth=8, label=band_label),
               Line2D([], [], color="k", linewidth=1.2, label=f"as composed (point 0): {base_text}"),
               *(Line2D([], [], color=s["color"], linewidth=6, alpha=0.8, label=s["label"])
                 for s in (LOW_END, HIGH_END, *([ONE_VALUE] if singles else [])))]
    ax.legend(handles=handles, fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, frameon=False)
    if simulated:
        ax.text(0.995, 0.02, "simulated", transform=ax.transAxes, ha="right", va="bottom", fontsize=9,
                color=OURS_STYLE["sim"]["color"], fontweight="bold", zorder=5)
    fig.suptitle(title, fontsize=9)
    return save_png(fig, path, dpi=90)
