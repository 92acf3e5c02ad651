"""HotSPa figures, drawn from a sweep's records (sim_matrix, sim_switch_policies, sim_ablation)."""
from __future__ import annotations

import pathlib
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from impl.common.plots.records import plottable  # noqa: E402
from impl.common.plots.save import save_png  # noqa: E402

BASELINE = "megatron_static"
CANDIDATES = ("hotspa", "hotspa_c2", "hotspa_planned", "hotspa_static")
POLICY_ORDER = ("bandwidth_greedy", "greedy_msgs", "node_aware_rr", "round_robin", "fcfs")


def _context_values(rec, metric: str) -> dict[int, float]:
    """context -> value of ``metric`` (the headline at the record's own context, the others
    from ``<metric>@ctx<C>``)."""
    m = rec["metrics"]
    out = {int(rec["info"]["context"]): m[metric]["value"]} if metric in m else {}
    for k, v in m.items():
        hit = re.fullmatch(re.escape(metric) + r"@ctx(\d+)", k)
        if hit:
            out[int(hit.group(1))] = v["value"]
    return out


def speedup_table(records, metric: str = "step_time_s", baseline: str = BASELINE) -> dict:
    """(system, workload, context) -> speedup of ``system`` over ``baseline`` (same workload)."""
    recs = plottable(records, metric)
    by = {(r["system"], r["workload"]): _context_values(r, metric) for r in recs}
    out = {}
    for (system, wl), vals in by.items():
        base = by.get((baseline, wl))
        if system == baseline or base is None:
            continue
        for ctx, v in vals.items():
            if ctx in base and v > 0:
                out[(system, wl, ctx)] = base[ctx] / v
    return out


def speedup_by_context(records, out_dir) -> list[pathlib.Path]:
    """One panel per dataset: speedup over megatron_static by context, one line per
    (system, model/GPUs)."""
    table = speedup_table(records)
    datasets = sorted({wl.rsplit("_", 1)[-1] for _, wl, _ in table})
    fig, axes = plt.subplots(1, max(len(datasets), 1), figsize=(6 * max(len(datasets), 1), 4.2), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        keys = sorted({(s, wl) for s, wl, _ in table if wl.endswith("_" + ds)},
                      key=lambda k: (CANDIDATES.index(k[0]) if k[0] in CANDIDATES else 99, k[1]))
        for s, wl in keys:
            pts = sorted((c, v) for (s2, w2, c), v in table.items() if (s2, w2) == (s, wl))
            style = "-" if s == "hotspa" else "--" if s == "hotspa_c2" else ":"
            ax.plot([c // 1024 for c, _ in pts], [v for _, v in pts], style, marker="o", ms=3,
                    label=f"{s} {wl.replace('hotspa_', '').rsplit('_', 1)[0]}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks([4, 8, 16, 32])
        ax.set_xticklabels(["4K", "8K", "16K", "32K"])
        ax.set_xlabel("max context (tokens)")
        ax.set_ylabel(f"speedup over {BASELINE} (x, step time, simulated)")
        ax.set_title(f"{ds}: HotSPa (sim, A800) vs static", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    path = save_png(fig, pathlib.Path(out_dir) / "speedup_by_context.png")
    return [path]


def switch_time_by_policy(records, out_dir) -> list[pathlib.Path]:
    """Switch time per step under each planner policy, one bar group per (workload, context)."""
    recs = [r for r in plottable(records, "switch_time_s") if r["system"].startswith("hotspa")]
    rows = {}
    for r in recs:
        for pol in POLICY_ORDER:
            for ctx, v in _context_values(r, f"switch_time_s@{pol}").items():
                rows.setdefault((r["workload"].replace("hotspa_", ""), r["system"], ctx), {})[pol] = v
    keys = sorted(k for k in rows if any(v > 0 for v in rows[k].values()))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(keys) + 2), 4.2))
    w = 0.8 / len(POLICY_ORDER)
    for pi, pol in enumerate(POLICY_ORDER):
        ax.bar([i + pi * w for i in range(len(keys))], [rows[k].get(pol, 0.0) for k in keys], w, label=pol)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(keys))])
    ax.set_xticklabels([f"{k[0]}\n{k[1]}\n{k[2] // 1024}K" for k in keys], fontsize=6)
    ax.set_ylabel("switch time per step (s, sim)")
    ax.set_title("HotSPa switch planner policies, same batches", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    path = save_png(fig, pathlib.Path(out_dir) / "switch_time_by_policy.png")
    return [path]


ABLATION_ARMS = (((False, True), "HotSPa (switch params, fused)"), ((True, True), "param replicas"),
                 ((False, False), "no buffer fusion"), ((True, False), "replicas, no fusion"))


def ablation_table(records) -> dict:
    """(workload, system, context) -> {(replicas, buffer_fusion): {metric: value}} (our
    "two replicas" and buffer-fusion ablations, read from each record's own ``system.sim``)."""
    out: dict = {}
    for r in plottable(records, "step_time_s"):
        if not r["system"].startswith("hotspa"):
            continue
        knobs = r["config"]["system"]["sim"]
        arm = (bool(knobs["replicas"]), bool(knobs["buffer_fusion"]))
        for metric in ("step_time_s", "switch_time_s", "peak_memory_gib"):
            for ctx, v in _context_values(r, metric).items():
                key = (r["workload"].replace("hotspa_", ""), r["system"], ctx)
                out.setdefault(key, {}).setdefault(arm, {})[metric] = v
    return out


def ablation(records, out_dir) -> list[pathlib.Path]:
    """Step time, switch time and peak memory per ablation arm, one bar group per case."""
    table = ablation_table(records)
    keys = sorted(table, key=lambda k: (k[0], k[1], -k[2]))
    panels = (("step_time_s", "step time (s, sim)"), ("switch_time_s", "switch time per step (s, sim)"),
              ("peak_memory_gib", "peak memory per GPU (GiB, sim)"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(7, 1.1 * len(keys) + 2), 9), sharex=True)
    w = 0.8 / len(ABLATION_ARMS)
    for ax, (metric, label) in zip(axes, panels):
        for ai, (arm, name) in enumerate(ABLATION_ARMS):
            ax.bar([i + ai * w for i in range(len(keys))],
                   [table[k].get(arm, {}).get(metric, float("nan")) for k in keys], w, label=name)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    for cap in sorted({r["info"]["memory_capacity_gib"] for r in plottable(records, "step_time_s")
                       if "memory_capacity_gib" in r.get("info", {})}):
        axes[-1].axhline(cap, color="k", lw=0.8, ls="--")
    axes[0].legend(fontsize=7)
    axes[0].set_title("HotSPa ablations: parameter replicas, buffer fusion; same batches", fontsize=9)
    axes[-1].set_xticks([i + 0.4 - w / 2 for i in range(len(keys))])
    axes[-1].set_xticklabels([f"{k[0]}\n{k[1]}\n{k[2] // 1024}K" for k in keys], fontsize=6)
    path = save_png(fig, pathlib.Path(out_dir) / "ablation.png")
    return [path]
