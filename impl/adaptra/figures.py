"""Paper-style figures for ADAPTRA experiments, drawn from a sweep's records."""
from __future__ import annotations

import collections
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ("1f1b", "zb", "falcon", "adaptra_cpu", "adaptra")
METRIC = "iteration_time_s"


def _ok(records):
    return [r for r in records if r.get("status") == "ok" and METRIC in r.get("metrics", {})]


def _systems(records):
    names = {r["system"] for r in records}
    return [s for s in ORDER if s in names] + sorted(names - set(ORDER))


def _mode_label(records) -> str:
    modes = {r["mode"] for r in records}
    return "simulated" if modes == {"sim"} else "measured" if modes == {"real"} else "sim+real"


def delay_sweep(records, out_dir) -> list[pathlib.Path]:
    """Iteration time vs injected delay, one line per system (the paper's delay-sweep plots);
    one figure per (workload, slow links)."""
    recs = _ok(records)
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
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_xlabel(f"injected delay per message on link {links} (ms)")
        ax.set_ylabel(f"iteration time (s, {_mode_label(recs)})")
        ax.set_title(f"{workload}: iteration time vs link delay", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = pathlib.Path(out_dir) / f"delay_sweep_{k}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def grouped_bars(records, out_dir, name: str = "scenarios") -> list[pathlib.Path]:
    """Iteration time per scenario (workload x fault), bars per system (the paper's tables)."""
    recs = _ok(records)
    scenarios = sorted({(r["workload"], r["fault"]) for r in recs})
    systems = _systems(recs)
    value = {(r["workload"], r["fault"], r["system"]): r["metrics"][METRIC]["value"] for r in recs}
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(scenarios) + 2), 4.5))
    width = 0.8 / max(len(systems), 1)
    for k, system in enumerate(systems):
        xs = [i + k * width for i in range(len(scenarios))]
        ax.bar(xs, [value.get((w, f, system), 0.0) for w, f in scenarios], width, label=system)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scenarios))])
    ax.set_xticklabels([f"{w}\n{f}" for w, f in scenarios], fontsize=6, rotation=30, ha="right")
    ax.set_ylabel(f"iteration time (s, {_mode_label(recs)})")
    ax.set_title(f"{name}: iteration time per scenario")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = pathlib.Path(out_dir) / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def single_link(records, out_dir):
    return grouped_bars(records, out_dir, "single_link")


def multi_link(records, out_dir):
    return grouped_bars(records, out_dir, "multi_link")
