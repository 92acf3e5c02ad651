"""CaraServe sweep figures, drawn from a multirun's records (``figure:`` in an experiment).

Both read the swept values from each record's resolved config, so a figure never depends on how
the runs were labelled."""
from __future__ import annotations

import collections
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from impl.common.plots.records import plottable  # noqa: E402
from impl.common.plots.save import save_png  # noqa: E402

PAPER_BAND = (1.3, 1.7)  # spec caraserve.md 6, S1: CaraServe 1.3-1.7x below S-LoRA at lambda >= 7


def _trace(r) -> dict:
    return r["config"]["workload"]["trace"]


def latency_ratios(records, base: str = "slora", mine: str = "caraserve") -> dict:
    """``{(rate, output median, load overhead): (base / mine mean latency, flagged)}`` for every
    point where both policies have a record; ``flagged`` when either run was marked invalid."""
    lat, flagged = {}, set()
    for r in plottable(records, "latency_mean_s", with_invalid=True):
        key = (_trace(r)["rate_rps"], _trace(r)["output_median"], r["config"]["system"]["cost"]["load_overhead_s"])
        lat[(key, r["config"]["system"]["policy"])] = r["metrics"]["latency_mean_s"]["value"]
        if r["status"] != "ok":
            flagged.add(key)
    out = {}
    for key in sorted({k for k, _ in lat}):
        a, b = lat.get((key, base)), lat.get((key, mine))
        if a is not None and b:
            out[key] = (a / b, key in flagged)
    return out


def latency_ratio_map(records, out_dir, base: str = "slora", mine: str = "caraserve") -> list[pathlib.Path]:
    """S1 sensitivity: mean-latency ratio ``base / mine`` per (output median, per-load overhead),
    one panel per arrival rate; cells inside the paper's band in bold with a '*'. Runs the
    harness flagged invalid (e.g. CaraServe's TTFT below CACHED's, spec 7) are drawn with a '!'
    because the ratio itself is still the simulated one; cells without both systems stay blank."""
    ratios = latency_ratios(records, base, mine)
    keys = sorted(ratios)
    if not keys:
        return []
    rates = sorted({k[0] for k in keys})
    outs = sorted({k[1] for k in keys})
    overheads = sorted({k[2] for k in keys})
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates) + 0.8, 3.6), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        grid = np.full((len(outs), len(overheads)), np.nan)
        for i, o in enumerate(outs):
            for j, h in enumerate(overheads):
                if (rate, o, h) in ratios:
                    grid[i, j] = ratios[(rate, o, h)][0]
        finite = grid[np.isfinite(grid)]
        im = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto", vmin=min(1.0, float(finite.min())),
                       vmax=max(2.0, float(finite.max())))
        for i in range(len(outs)):
            for j in range(len(overheads)):
                if np.isfinite(grid[i, j]):
                    inside = PAPER_BAND[0] <= grid[i, j] <= PAPER_BAND[1]
                    mark = ("*" if inside else "") + ("!" if ratios[(rate, outs[i], overheads[j])][1] else "")
                    ax.text(j, i, f"{grid[i, j]:.2f}{mark}", ha="center", va="center", fontsize=8,
                            color="white", fontweight="bold" if inside else "normal")
        ax.set_xticks(range(len(overheads)))
        ax.set_xticklabels([f"{h * 1e3:g}" for h in overheads])
        ax.set_yticks(range(len(outs)))
        ax.set_yticklabels([f"{o:g}" for o in outs])
        ax.set_xlabel("added cost per adapter load (ms)")
        ax.set_ylabel("output length median (tokens)")
        ax.set_title(f"{rate:g} RPS", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"simulated mean latency {base} / {mine}   (*: inside the paper's {PAPER_BAND[0]}-"
                 f"{PAPER_BAND[1]}x;  !: a run flagged invalid)", fontsize=9)
    path = save_png(fig, pathlib.Path(out_dir) / "latency_ratio_map.png")
    return [path]


def slo_vs_rate(records, out_dir) -> list[pathlib.Path]:
    """S3 capacity: SLO attainment against the offered rate, one line per router."""
    pts = collections.defaultdict(dict)
    for r in plottable(records, "slo_attainment"):
        pts[r["system"]][_trace(r)["rate_rps"]] = r["metrics"]["slo_attainment"]["value"]
    if not pts:
        return []
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name in sorted(pts):
        xs = sorted(pts[name])
        ax.plot(xs, [100 * pts[name][x] for x in xs], marker="o", label=name)
    ax.axhline(99, color="k", ls="--", lw=0.8)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title("simulated SLO attainment vs load (dashed: 99%)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = save_png(fig, pathlib.Path(out_dir) / "slo_vs_rate.png")
    return [path]
