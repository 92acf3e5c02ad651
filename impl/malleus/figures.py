"""Malleus figures, drawn from a sweep's records."""
from __future__ import annotations

import collections
import pathlib
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from impl.common.plots.records import mode_legend_entry, mode_style, plottable  # noqa: E402
from impl.common.plots.save import save_png  # noqa: E402

ORDER = ("uniform", "data_only", "layers_only", "restart_replan", "malleus")
METRIC = "iteration_time_s"


def speedups(records, out_dir, name: str = "speedup") -> list[pathlib.Path]:
    """Speedup over the uniform plan per system, one bar group per (experiment, workload, hardware);
    the straggler-free bound (uniform time / straggler-free time) as a marker."""
    recs = plottable(records, METRIC)
    t = {}
    free = {}
    for r in recs:
        key = (r["experiment"].split("/")[-1], r["workload"], r["hardware"])
        t[(key, r["system"])] = r["metrics"][METRIC]["value"]
        if "straggler_free_iteration_time_s" in r["metrics"]:
            free[key] = r["metrics"]["straggler_free_iteration_time_s"]["value"]
    keys = sorted({k for k, _ in t})
    systems = [s for s in ORDER if any((k, s) in t for k in keys)] + sorted({s for _, s in t} - set(ORDER))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys) + 2), 4))
    w = 0.8 / max(len(systems), 1)
    for si, s in enumerate(systems):
        xs, ys = [], []
        for ki, k in enumerate(keys):
            if (k, s) in t and (k, "uniform") in t:
                xs.append(ki + si * w)
                ys.append(t[(k, "uniform")] / t[(k, s)])
        ax.bar(xs, ys, w, label=s, hatch=mode_style(recs)["hatch"], edgecolor="white")
    for ki, k in enumerate(keys):
        if k in free and (k, "uniform") in t:
            ax.plot([ki - w / 2, ki + 0.8 - w / 2], [t[(k, "uniform")] / free[k]] * 2, "k--", lw=1)
    ax.set_xticks([ki + 0.4 - w / 2 for ki in range(len(keys))])
    ax.set_xticklabels([f"{k[0]}\n{k[1].replace('hybrid_', '')}\n{k[2]}" for k in keys], fontsize=7)
    modes = {r["mode"] for r in recs}
    ax.set_ylabel(f"speedup over uniform (x, {METRIC}; {'simulated' if modes == {'sim'} else 'measured' if modes == {'real'} else 'sim+real'})")
    ax.set_title("Malleus and baselines vs uniform (dashed: straggler-free bound)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    mode_legend_entry(ax, recs)
    ax.legend(fontsize=7)
    path = save_png(fig, pathlib.Path(out_dir) / f"{name}.png")
    return [path]


def trace_series(record: dict) -> dict[str, tuple[list[int], list[float]]]:
    """``{label: (iterations, seconds)}`` of one record's per-iteration times. An interleaved run
    (``system.interleave``: one iteration of each plan per round after the warm-up) is split
    into one series per plan, labelled by it; warm-up iterations are their own series."""
    info = record.get("info") if isinstance(record.get("info"), dict) else {}
    times = info.get("iteration_times_s") or []
    cfg = record.get("config") or {}
    interleave = list((cfg.get("system") or {}).get("interleave") or [])
    if not interleave:
        return {record["system"]: (list(range(len(times))), list(times))} if times else {}
    warmup = int((cfg.get("workload") or {}).get("warmup_iterations") or 0)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for i, t in enumerate(times):
        label = "warm-up (uniform)" if i < warmup else interleave[(i - warmup) % len(interleave)]
        xs, ys = out.setdefault(label, ([], []))
        xs.append(i)
        ys.append(t)
    return out


def iteration_trace(records, out_dir) -> list[pathlib.Path]:
    """Real/S7 runs: iteration time per iteration, one line per system, or per plan of an
    interleaved run; measured runs solid with dots, simulated dashed, invalid ones marked."""
    recs = [r for r in records if r.get("status") in ("ok", "invalid")]
    fig, ax = plt.subplots(figsize=(7, 4))
    several = len(recs) > 1
    for r in sorted(recs, key=lambda r: r["system"]):
        for label, (xs, ys) in trace_series(r).items():
            tag = f"{r['system']}: {label}" if several and label != r["system"] else label
            tag += (" (measured)" if r["mode"] == "real" else " (simulated)")
            tag += " [invalid]" if r["status"] == "invalid" else ""
            ax.plot(xs, ys, marker="." if r["mode"] == "real" else None,
                    linestyle="-" if r["mode"] == "real" else "--", label=tag)
    ax.set_xlabel("iteration")
    ax.set_ylabel("iteration time (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = save_png(fig, pathlib.Path(out_dir) / "iteration_trace.png")
    return [path]


def speedups_total(records, out_dir) -> list[pathlib.Path]:
    """Like :func:`speedups`, on total time (dynamic runs: detection, planning, migration and
    restarts all count)."""
    global METRIC
    saved, METRIC = METRIC, "total_time_s"
    try:
        return speedups(records, out_dir, name="speedup_total")
    finally:
        METRIC = saved
