"""Hydraulis figures, drawn from a sweep's records (experiment=hydraulis/s1..s6)."""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from impl.common.plots.records import mode_legend_entry, mode_style, plottable  # noqa: E402
from impl.common.plots.save import save_png  # noqa: E402

ORDER = ("hydraulis", "hydraulis_static_hetero", "hydraulis_token_balanced", "hydraulis_homo",
         "hydraulis_greedy_dynamic", "hydraulis_greedy_static", "hydraulis_equal", "hydraulis_pad",
         "hotspa_like", "hotspa_planned", "deepspeed_like", "megatron_like")
BASELINES = ("megatron_like", "deepspeed_like", "hotspa_like", "hotspa_planned")


def _tps(rec) -> float:
    m = rec["metrics"]
    return (m.get("tokens_per_s") or m["throughput_tokens_per_s"])["value"]


def speedups(records) -> dict:
    """workload -> {system: tokens/s, ...} and the best baseline's name and speedup."""
    recs = [r for r in plottable(records, "step_time_s")
            if "tokens_per_s" in r["metrics"] or "throughput_tokens_per_s" in r["metrics"]]
    out: dict = {}
    for r in recs:
        out.setdefault(r["workload"], {})[r["system"]] = _tps(r)
    table = {}
    for wl, by in out.items():
        base = {s: v for s, v in by.items() if s in BASELINES}
        if "hydraulis" in by and base:
            best = max(base, key=base.get)
            table[wl] = {"tokens_per_s": by, "best_baseline": best, "speedup": by["hydraulis"] / base[best]}
        else:
            table[wl] = {"tokens_per_s": by}
    return table


def tokens_per_s_by_system(records, out_dir) -> list[pathlib.Path]:
    """One bar group per workload: tokens/s of each system (simulated)."""
    recs = plottable(records, "step_time_s")
    table = speedups(recs)
    wls = sorted(table)
    systems = [s for s in ORDER if any(s in table[w]["tokens_per_s"] for w in wls)]
    style = mode_style(recs)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(wls) * max(1, len(systems)) / 6 + 3), 4.4))
    w = 0.8 / max(1, len(systems))
    for si, s in enumerate(systems):
        xs = [i + si * w for i, wl in enumerate(wls) if s in table[wl]["tokens_per_s"]]
        ys = [table[wl]["tokens_per_s"][s] / 1e3 for wl in wls if s in table[wl]["tokens_per_s"]]
        ax.bar(xs, ys, w, label=s, hatch=style["hatch"], edgecolor="0.3", linewidth=0.4)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(wls))])
    ax.set_xticklabels([wl.replace("hydraulis_", "") + (f"\n{table[wl]['speedup']:.2f}x vs {table[wl]['best_baseline']}"
                                                        if "speedup" in table[wl] else "") for wl in wls], fontsize=7)
    ax.set_ylabel(f"tokens/s (thousands, {style['word']})")
    ax.set_title("Hydraulis vs baselines, same per-step batches (sim)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    mode_legend_entry(ax, recs)
    ax.legend(fontsize=6, ncol=2)
    paths = [save_png(fig, pathlib.Path(out_dir) / "tokens_per_s_by_system.png")]
    pool = [r for r in recs if r["system"] == "hydraulis" and r.get("info", {}).get("pool")]
    if pool:
        paths += candidate_pool(pool, out_dir)
    return paths


def candidate_pool(records, out_dir) -> list[pathlib.Path]:
    """The Fig. 14 case study: each pool candidate and how many measured steps it won."""
    paths = []
    for r in records:
        info = r["info"]
        pool = info["pool"]
        wins = info.get("winner_counts", {})
        labels = [p.split(":", 1)[1].split("[")[0].strip() for p in pool]
        counts = [wins.get(lab, 0) for lab in labels]
        fig, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.5))
        ax.barh(range(len(labels)), counts, color=["0.5"] + ["C0"] * (len(labels) - 1))
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels([f"{i}: {lab}" for i, lab in enumerate(labels)], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"steps won (of {info.get('steps')}, simulated)")
        ax.set_title(f"candidate pool, {r['workload']} (0 = optimizer layout {info.get('opt_layout')})", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        paths.append(save_png(fig, pathlib.Path(out_dir) / f"candidate_pool_{r['workload']}.png"))
    return paths


def plan_time_vs_gpus(records, out_dir) -> list[pathlib.Path]:
    """S5: planner wall time per step (this host) and simulated step time, by GPU count."""
    recs = [r for r in plottable(records, "plan_time_s") if r["system"] == "hydraulis"]
    paths = tokens_per_s_by_system(records, out_dir)
    if not recs:
        return paths
    pts = sorted((r["info"]["num_gpus"], r["metrics"]["plan_time_s"]["value"], r["metrics"]["step_time_s"]["value"])
                 for r in recs)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label="planner wall time per step (measured, this host)")
    ax.plot([p[0] for p in pts], [p[2] for p in pts], "--s", label="step time (simulated)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("seconds")
    ax.set_title("Hydraulis planner scalability (32B, CommonCrawl, 32K)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(save_png(fig, pathlib.Path(out_dir) / "plan_time_vs_gpus.png"))
    return paths
