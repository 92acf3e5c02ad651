"""Paper-style figures for ADAPTRA experiments, drawn from a sweep's records."""
from __future__ import annotations

import collections
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from impl.common.plots.records import mode_legend_entry, mode_style, plottable  # noqa: E402
from impl.common.plots.save import save_png  # noqa: E402

ORDER = ("1f1b", "zb", "falcon", "adaptra_cpu", "adaptra")
METRIC = "iteration_time_s"


def _systems(records):
    names = {r["system"] for r in records}
    return [s for s in ORDER if s in names] + sorted(names - set(ORDER))


def _mode_label(records) -> str:
    modes = {r["mode"] for r in records}
    return "simulated" if modes == {"sim"} else "measured" if modes == {"real"} else "sim+real"


def delay_sweep(records, out_dir) -> list[pathlib.Path]:
    """Iteration time vs injected delay, one line per system (the paper's delay-sweep plots);
    one figure per (workload, slow links)."""
    recs = plottable(records, METRIC)
    series = collections.defaultdict(list)
    for r in recs:
        fault = r["config"]["fault"]
        delay_ms = float(fault.get("delay_s", 0.0)) * 1e3
        links = "+".join(f"{a}-{b}" for a, b in fault.get("links", []))
        series[(r["workload"], links, r["system"])].append((delay_ms, r["metrics"][METRIC]["value"]))
    paths = []
    for k, (workload, links) in enumerate(sorted({(w, lk) for w, lk, _ in series})):
        fig, ax = plt.subplots(figsize=(6, 4))
        for system in _systems(recs):
            pts = sorted(series.get((workload, links, system), []))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system,
                        linestyle=mode_style(recs)["linestyle"])
        ax.set_xlabel(f"injected delay per message on link {links} (ms)")
        ax.set_ylabel(f"iteration time (s, {_mode_label(recs)})")
        ax.set_title(f"{workload}: iteration time vs link delay", fontsize=9)
        ax.grid(alpha=0.3)
        mode_legend_entry(ax, recs, "line")
        ax.legend()
        path = save_png(fig, pathlib.Path(out_dir) / f"delay_sweep_{k}.png")
        paths.append(path)
    return paths


def grouped_bars(records, out_dir, name: str = "scenarios") -> list[pathlib.Path]:
    """Iteration time per scenario (workload x fault), bars per system (the paper's tables)."""
    recs = plottable(records, METRIC)
    scenarios = sorted({(r["workload"], r["fault"]) for r in recs})
    systems = _systems(recs)
    value = {(r["workload"], r["fault"], r["system"]): r["metrics"][METRIC]["value"] for r in recs}
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(scenarios) + 2), 4.5))
    width = 0.8 / max(len(systems), 1)
    for k, system in enumerate(systems):
        xs = [i + k * width for i in range(len(scenarios))]
        # A missing (failed) job draws no bar rather than a zero that would look fastest.
        ax.bar(xs, [value.get((w, f, system), float("nan")) for w, f in scenarios], width, label=system,
               hatch=mode_style(recs)["hatch"], edgecolor="white")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scenarios))])
    ax.set_xticklabels([f"{w}\n{f}" for w, f in scenarios], fontsize=6, rotation=30, ha="right")
    ax.set_ylabel(f"iteration time (s, {_mode_label(recs)})")
    ax.set_title(f"{name}: iteration time per scenario")
    mode_legend_entry(ax, recs)
    ax.legend(fontsize=8)
    path = save_png(fig, pathlib.Path(out_dir) / f"{name}.png")
    return [path]


def single_link(records, out_dir):
    return grouped_bars(records, out_dir, "single_link")


def multi_link(records, out_dir):
    return grouped_bars(records, out_dir, "multi_link")


# ---- S5-S7 ------------------------------------------------------------------------------------
# Paper numbers drawn as black markers next to ours (the paper's evaluation; also in
# impl/adaptra/paper.yaml).
PAPER_DP_LINK = {  # s/iteration at 10/20/30 ms
    "zb": (1.87, 2.79, 3.94), "falcon": (0.64, 0.86, 1.10), "adaptra_cpu": (0.54, 0.63, 0.71),
    "adaptra": (0.53, 0.55, 0.56)}
PAPER_TIME_VARYING = {  # s/iteration, traces A/B/C
    "1f1b": (1.39, 1.35, 1.34), "zb": (1.28, 1.27, 1.21), "adaptra_cpu": (0.81, 0.84, 0.77),
    "adaptra": (0.58, 0.55, 0.55)}
PAPER_TRACE_140B_MIN = {"1f1b": 45.4, "zb": 46.9, "adaptra": 33.2}


def _bars_vs_paper(records, out_dir, *, name, key_fn, key_labels, metric, ylabel, title, paper=None,
                   secondary=None, log=False) -> list[pathlib.Path]:
    """Bars per (scenario key, system) of ``metric``; optional hollow marker for ``secondary``
    and a black x for the paper's value."""
    recs = [r for r in records if r.get("status") == "ok" and metric in r.get("metrics", {})]
    keys = sorted({key_fn(r) for r in recs})
    systems = _systems(recs)
    val = {(key_fn(r), r["system"]): r for r in recs}
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys) + 2), 4.5))
    width = 0.8 / max(len(systems), 1)
    for k, system in enumerate(systems):
        xs = [i + k * width for i in range(len(keys))]
        ys = [val[(key, system)]["metrics"][metric]["value"] if (key, system) in val else 0.0 for key in keys]
        ax.bar(xs, ys, width, label=system, hatch=mode_style(recs)["hatch"], edgecolor="white")
        if secondary:
            sec = [val[(key, system)]["metrics"][secondary]["value"] if (key, system) in val else None for key in keys]
            pts = [(x, y) for x, y in zip(xs, sec) if y is not None]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker="o", facecolors="none", edgecolors="k",
                       s=25, zorder=3, label=secondary.replace("_", " ") if k == 0 else None)
        if paper and system in paper:
            ref = paper[system]
            pts = [(x, ref[key_labels.index(key)] if isinstance(ref, tuple) else ref)
                   for x, key in zip(xs, keys) if key in key_labels]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker="x", color="k", s=30, zorder=3,
                       label="paper" if k == 0 else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    ax.set_xticklabels([str(k) for k in keys])
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(f"{ylabel} ({_mode_label(recs)})")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    mode_legend_entry(ax, recs)
    ax.legend(fontsize=7)
    path = save_png(fig, pathlib.Path(out_dir) / f"{name}.png")
    return [path]


def dp_link(records, out_dir):
    """S5: steady-state iteration time per DP-link delay (bars), run mean (circles), paper (x)."""
    labels = ("10 ms", "20 ms", "30 ms")
    return _bars_vs_paper(
        records, out_dir, name="dp_link", key_labels=labels,
        key_fn=lambda r: f"{float(r['config']['fault']['delay_s']) * 1e3:.0f} ms",
        metric="steady_iteration_time_s", secondary="mean_iteration_time_s", paper=PAPER_DP_LINK, log=True,
        ylabel="steady-state iteration time (s)", title="S5: DP-link straggler, 7B (1,2,4)")


def time_varying(records, out_dir):
    """S6: mean iteration time per trace (A/B/C = change interval), paper (x)."""
    names = {(0.05, 0.1): "A U(50,100) ms", (0.1, 0.2): "B U(100,200) ms", (0.2, 0.4): "C U(200,400) ms"}

    def key(r):
        iv = tuple(float(x) for x in r["config"]["fault"]["interval_s"])
        return names.get(iv, f"U({iv[0] * 1e3:.0f},{iv[1] * 1e3:.0f}) ms")

    return _bars_vs_paper(records, out_dir, name="time_varying", key_fn=key, key_labels=tuple(names.values()),
                          metric="mean_iteration_time_s", paper=PAPER_TIME_VARYING,
                          ylabel="mean iteration time (s)", title="S6: time-varying link delays, 7B (1,1,4)")


def trace_140b(records, out_dir) -> list[pathlib.Path]:
    """S7: cumulative training time over the 1200-iteration trace (restarts as jumps), and the
    total per system next to the paper's."""
    recs = [r for r in records if r.get("status") == "ok" and "total_time_min" in r.get("metrics", {})]
    systems = _systems(recs)
    by = {r["system"]: r for r in recs}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for system in systems:
        info = by[system].get("info", {})
        times = info.get("iteration_times_s") or []
        costs = {}
        for e in info.get("events", []):
            costs[e["iteration"]] = costs.get(e["iteration"], 0.0) + e["cost_s"]
        first = int(info.get("plans", [{}])[0].get("iteration", 0)) if info.get("plans") else 0
        acc, ys = 0.0, []
        for k, t in enumerate(times):
            acc += costs.get(first + k, 0.0) + t
            ys.append(acc / 60.0)
        ax.plot(range(first, first + len(ys)), ys, label=system)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"cumulative training time (min, {_mode_label(recs)})")
    ax.set_title("S7: 140B (8,2,8), 1200-iteration trace + RNIC failure")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    xs = range(len(systems))
    bx.bar(xs, [by[s]["metrics"]["total_time_min"]["value"] for s in systems],
           color=[f"C{i}" for i in range(len(systems))])
    ref = [(i, PAPER_TRACE_140B_MIN[s]) for i, s in enumerate(systems) if s in PAPER_TRACE_140B_MIN]
    bx.scatter([p[0] for p in ref], [p[1] for p in ref], marker="x", color="k", zorder=3, label="paper")
    bx.set_xticks(list(xs))
    bx.set_xticklabels(systems, rotation=20, fontsize=8)
    bx.set_ylabel("total time (min)")
    bx.legend(fontsize=8)
    path = save_png(fig, pathlib.Path(out_dir) / "trace_140b.png")
    return [path]
