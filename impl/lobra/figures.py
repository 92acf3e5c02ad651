"""LobRA figures, drawn from a sweep's records (the ``figure:`` of the sim presets) or from a
results directory::

    python -m impl.lobra.figures RESULTS_DIR [OUT_DIR]   # every LobRA preset found -> OUT_DIR

- :func:`gpu_seconds_by_system`: GPU-seconds per system, one bar group per case (workload x
  GPU count), the label of each bar its GPU-seconds change against Task-Fused (e2e_*, ablation,
  task_scaling);
- :func:`buckets_sweep`: padding ratio and step time against the bucket count B (buckets);
- :func:`gpu_scaling`: GPU-seconds by system per GPU count, and planner time against GPUs.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from impl.common.plots.records import mode_legend_entry, mode_style, plottable  # noqa: E402
from impl.common.plots.save import save_png  # noqa: E402

SYSTEM_ORDER = ("task_fused", "lobra_homo_length", "lobra_length", "lobra_balanced_fixed", "lobra",
                "task_sequential")
BASELINE = "task_fused"


def _gpus(rec) -> int:
    return int(rec["info"].get("num_gpus") or rec["config"]["workload"]["num_gpus"])


def _latest(records) -> list[dict]:
    """One record per (system, workload, GPUs, B): the newest (re-runs replace older ones)."""
    by = {}
    for r in sorted(records, key=lambda r: r.get("created", "")):
        by[(r["system"], r["workload"], _gpus(r), r["config"]["system"].get("num_buckets"))] = r
    return list(by.values())


def _natural(s: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s))


def _order(system: str) -> int:
    return SYSTEM_ORDER.index(system) if system in SYSTEM_ORDER else len(SYSTEM_ORDER)


def gpu_seconds_by_system(records, out_dir, name: str = "gpu_seconds_by_system.png") -> list[pathlib.Path]:
    recs = _latest(plottable(records, "gpu_seconds"))
    if not recs:
        return []
    cases = sorted({(_gpus(r), r["workload"]) for r in recs}, key=lambda c: (c[0], _natural(c[1])))
    systems = sorted({r["system"] for r in recs}, key=_order)
    val = {(r["system"], _gpus(r), r["workload"]): r["metrics"]["gpu_seconds"]["value"] for r in recs}
    style = mode_style(recs)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cases) * len(systems) / 2 + 2), 4.4))
    w = 0.8 / len(systems)
    for si, s in enumerate(systems):
        xs, ys, labels = [], [], []
        for ci, (g, wl) in enumerate(cases):
            v = val.get((s, g, wl))
            if v is None:
                continue
            base = val.get((BASELINE, g, wl))
            xs.append(ci + si * w)
            ys.append(v)
            labels.append("" if s == BASELINE or not base else f"{100 * (v / base - 1):+.0f}%")
        bars = ax.bar(xs, ys, w, label=s, hatch=style["hatch"], edgecolor="0.3")
        ax.bar_label(bars, labels, fontsize=6, padding=1)
    if max(val.values()) > 10 * min(val.values()):
        ax.set_yscale("log")  # one baseline an order of magnitude off would flatten the rest
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"{wl.split('[')[0].replace('lobra_', '')}\n{g} GPUs" for g, wl in cases], fontsize=7)
    unit = recs[0]["metrics"]["gpu_seconds"].get("unit", "GPU-s")
    ax.set_ylabel(f"{unit} over the run ({style['word']})")
    ax.set_title(f"{recs[0]['experiment']}: GPU-seconds by system (bar labels: change vs {BASELINE})", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    mode_legend_entry(ax, recs)
    ax.legend(fontsize=7)
    return [save_png(fig, pathlib.Path(out_dir) / name)]


def buckets_sweep(records, out_dir) -> list[pathlib.Path]:
    recs = sorted(_latest(plottable(records, "padding_ratio")), key=lambda r: r["config"]["system"]["num_buckets"])
    recs = [r for r in recs if r["system"] == "lobra"]
    if not recs:
        return []
    B = [r["config"]["system"]["num_buckets"] for r in recs]
    style = mode_style(recs)
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    ax.plot(B, [r["metrics"]["padding_ratio"]["value"] for r in recs], style["linestyle"], marker="o",
            color="C0", label="padding ratio (median step)")
    ax.set_xlabel("bucket count B (dynamic bucketing)")
    ax.set_ylabel("padding ratio", color="C0")
    ax2 = ax.twinx()
    ax2.plot(B, [r["metrics"]["step_time_s"]["value"] for r in recs], style["linestyle"], marker="s", color="C1",
             label="step time (median)")
    ax2.set_ylabel(f"step time (s, {style['word']})", color="C1")
    ax2.set_ylim(bottom=0)
    ax.set_ylim(bottom=0)
    ax.set_xticks(B)
    ax.grid(alpha=0.3)
    ax.set_title(f"{recs[0]['experiment']} ({recs[0]['workload']}): padding and step time vs B", fontsize=9)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper center")
    return [save_png(fig, pathlib.Path(out_dir) / "buckets_padding_step_time.png")]


def planner_time_by_gpus(records, out_dir) -> list[pathlib.Path]:
    recs = sorted((r for r in _latest(plottable(records, "planner_time_s")) if r["system"] == "lobra"), key=_gpus)
    if not recs:
        return []
    style = mode_style(recs)
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    ax.plot([_gpus(r) for r in recs], [r["metrics"]["planner_time_s"]["value"] for r in recs], style["linestyle"],
            marker="o", label="PRUNE planner (this harness, wall time)")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("static planner time (s)")
    ax.set_xticks([_gpus(r) for r in recs])
    ax.grid(alpha=0.3)
    ax.set_title(f"{recs[0]['experiment']} ({recs[0]['workload']}): deployment planner time vs GPUs", fontsize=9)
    ax.legend(fontsize=7)
    return [save_png(fig, pathlib.Path(out_dir) / "planner_time_by_gpus.png")]


def gpu_scaling(records, out_dir) -> list[pathlib.Path]:
    return gpu_seconds_by_system(records, out_dir) + planner_time_by_gpus(records, out_dir)


# experiment name -> the figure function of its preset
BY_EXPERIMENT = {
    "lobra/e2e_7b": gpu_seconds_by_system, "lobra/e2e_32b": gpu_seconds_by_system,
    "lobra/e2e_70b": gpu_seconds_by_system, "lobra/ablation": gpu_seconds_by_system,
    "lobra/task_scaling": gpu_seconds_by_system, "lobra/gpu_scaling": gpu_scaling, "lobra/buckets": buckets_sweep,
}


def draw_all(records, out_dir) -> list[pathlib.Path]:
    """Every LobRA preset among ``records`` -> ``OUT_DIR/<preset>/*.png``."""
    out = []
    for exp, fn in BY_EXPERIMENT.items():
        recs = [r for r in records if r.get("experiment") == exp]
        if recs:
            out += fn(recs, pathlib.Path(out_dir) / exp.split("/", 1)[1])
    return out


def load_records(results_dir) -> list[dict]:
    """Every ``<results_dir>/<run_id>/record.json`` (the harness's layout; impl may not import
    bench, so this reads the files itself)."""
    return [json.loads(p.read_text()) for p in sorted(pathlib.Path(results_dir).glob("*/record.json"))]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(argv) <= 2:
        print("usage: python -m impl.lobra.figures RESULTS_DIR [OUT_DIR]", file=sys.stderr)
        return 2
    out_dir = argv[1] if len(argv) > 1 else argv[0]
    for p in draw_all(load_records(argv[0]), out_dir):
        print(f"figure: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
