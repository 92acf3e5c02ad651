"""Checkpoint-recovery figures from sim records (reconstructed [R]: impl/ckpt_recovery/README.md,
"Sim"): time lost per failure by system and storage profile, and ETTR by system, one panel per scenario.

Run on a results folder: ``python -m impl.ckpt_recovery.figures RESULTS_DIR OUT_DIR``.
"""
from __future__ import annotations

import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from impl.common.plots.records import mode_legend_entry, mode_style, plottable  # noqa: E402
from impl.common.plots.save import save_png  # noqa: E402

SYSTEMS = ("ckpt_recovery", "ckpt_recovery_local", "ckpt_recovery_peer", "dcp_sync", "dcp_async", "restart_all", "ucp_like", "gemini_like")
PROFILES = ("nas5", "nas20", "nvme", "network")


def _latest(records, metric: str) -> dict:
    """(experiment, system) -> the newest ok record reporting ``metric``."""
    out = {}
    for r in sorted(plottable(records, metric), key=lambda r: r.get("created", "")):
        out[(r["experiment"], r["system"])] = r
    return out


def _scenarios(by) -> list[str]:
    return sorted({e for e, _ in by})


def _systems(by, exp) -> list[str]:
    return [s for s in SYSTEMS if (exp, s) in by] + sorted(s for e, s in by if e == exp and s not in SYSTEMS)


def _grid(n: int, per_row: int = 3):
    rows, cols = -(-max(n, 1) // per_row), min(max(n, 1), per_row)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.9 * rows), squeeze=False)
    flat = [a for row in axes for a in row]
    for a in flat[n:]:
        a.axis("off")
    return fig, flat


def t_lost_by_storage(records, out_dir) -> pathlib.Path:
    by = _latest(records, "t_lost_s")
    exps = _scenarios(by)
    fig, axes = _grid(len(exps))
    style = mode_style(by.values())
    for ax, exp in zip(axes, exps):
        systems = _systems(by, exp)
        w = 0.8 / len(PROFILES)
        for k, prof in enumerate(PROFILES):
            vals = [by[(exp, s)]["metrics"].get(f"t_lost_s@{prof}", {}).get("value", float("nan")) / 60.0 for s in systems]
            ax.bar([i + (k - 1.5) * w for i in range(len(systems))], vals, w, label=prof, hatch=style["hatch"],
                   edgecolor="0.3", linewidth=0.4)
        ax.set_xticks(range(len(systems)))
        ax.set_xticklabels(systems, rotation=40, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel(f"time lost per failure (min, {style['word']})", fontsize=8)
        ax.set_title(exp, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    mode_legend_entry(axes[0], by.values())
    axes[0].legend(fontsize=6)
    return save_png(fig, pathlib.Path(out_dir) / "t_lost_by_storage.png")


def ettr_by_system(records, out_dir) -> pathlib.Path:
    by = _latest(records, "ettr")
    exps = _scenarios(by)
    fig, axes = _grid(len(exps))
    style = mode_style(by.values())
    for ax, exp in zip(axes, exps):
        systems = _systems(by, exp)
        w = 0.8 / len(PROFILES)
        lo_all = 1.0
        for k, prof in enumerate(PROFILES):
            ms = [by[(exp, s)]["metrics"].get(f"ettr@{prof}") for s in systems]
            vals = [m["value"] if m else float("nan") for m in ms]
            err = [[max(0.0, m["value"] - m["p10"]) if m else 0.0 for m in ms],
                   [max(0.0, m["p90"] - m["value"]) if m else 0.0 for m in ms]]
            ax.bar([i + (k - 1.5) * w for i in range(len(systems))], vals, w, yerr=err, capsize=1.5, label=prof,
                   hatch=style["hatch"], edgecolor="0.3", linewidth=0.4, error_kw={"lw": 0.6})
            lo_all = min([lo_all] + [v - e for v, e in zip(vals, err[0]) if v == v])
        ax.set_ylim(max(0.0, lo_all - 0.2 * (1.0 - lo_all) - 1e-4), 1.0)
        ax.set_xticks(range(len(systems)))
        ax.set_xticklabels(systems, rotation=40, ha="right", fontsize=7)
        poisson = any(by[(exp, s)]["metrics"]["ettr"].get("n", 1) > 1 for s in systems)
        ax.set_ylabel("ETTR" + (" over 7 days (mean, p10-p90)" if poisson else " (at the failure rate)"), fontsize=8)
        ax.set_title(exp, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    mode_legend_entry(axes[0], by.values())
    axes[0].legend(fontsize=6)
    return save_png(fig, pathlib.Path(out_dir) / "ettr_by_system.png")


def scenario_figures(records, out_dir) -> list[pathlib.Path]:
    return [t_lost_by_storage(records, out_dir), ettr_by_system(records, out_dir)]


def read_records(results_dir) -> list[dict]:
    path = pathlib.Path(results_dir) / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    recs = [r for d in sys.argv[1:-1] for r in read_records(d)]
    for p in scenario_figures(recs, sys.argv[-1]):
        print(p)
