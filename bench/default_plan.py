"""What `mlsys-bench` runs with no arguments: the steps of ``bench/data/default_plan.yaml``.

Each step is one `mlsys-bench` command line (a single job or a multirun); they run as child
processes so that each gets a fresh Hydra, and their records are then compared side by side.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import List

from omegaconf import OmegaConf


# Children skip their own end-of-sweep table: the plan prints one table of all steps.
QUIET_TABLE_ENV = "MLSYS_BENCH_NO_SWEEP_TABLE"


@dataclass
class PlanStep:
    title: str = "???"
    args: List[str] = field(default_factory=list)


@dataclass
class DefaultPlan:
    results_dir: str = "results/runs"
    baseline: str = ""
    # Metrics shown in the closing table (all metrics stay in the records and report.md).
    metrics: List[str] = field(default_factory=list)
    steps: List[PlanStep] = field(default_factory=list)


def load_plan() -> DefaultPlan:
    text = resources.files("bench").joinpath("data", "default_plan.yaml").read_text()
    merged = OmegaConf.merge(OmegaConf.structured(DefaultPlan), OmegaConf.create(text))
    return OmegaConf.to_object(merged)


def run_default_plan() -> int:
    plan = load_plan()
    seen = {r["run_id"] for r in _safe_load(plan.results_dir)}
    failures = 0
    per_step: list[list[dict]] = []
    for i, step in enumerate(plan.steps, 1):
        print(f"[{i}/{len(plan.steps)}] {step.title}: mlsys-bench {' '.join(step.args)}", flush=True)
        t0 = time.perf_counter()
        # The step's own output (job summaries, progress bars) streams through as it runs.
        proc = subprocess.run([sys.executable, "-m", "bench", *step.args, f"results_dir={plan.results_dir}"],
                              env={**os.environ, QUIET_TABLE_ENV: "1"})
        took = time.perf_counter() - t0
        if proc.returncode != 0:
            failures += 1
            print(f"    step {i} failed (exit {proc.returncode}) after {took:.1f} s", flush=True)
        else:
            print(f"    step {i} done in {took:.1f} s", flush=True)
        new = [r for r in _safe_load(plan.results_dir) if r["run_id"] not in seen]
        seen |= {r["run_id"] for r in new}
        per_step.append(new)
    if any(per_step):
        print()
        print(closing_story(plan, per_step), end="")
    print(f"\nrecords: {plan.results_dir}/records.jsonl  (compare again: mlsys-bench-compare --results {plan.results_dir};"
          f" HTML report: mlsys-bench-report --results {plan.results_dir} --out report/)")
    return 1 if failures else 0


def closing_story(plan: DefaultPlan, per_step: list[list[dict]]) -> str:
    """The default run's closing text, one section per step in plan order: what ran, its
    table, and one line per system saying how it did against the baseline (when present)."""
    from bench.compare import compare_records, format_table

    out: list[str] = []
    for i, (step, records) in enumerate(zip(plan.steps, per_step), 1):
        out.append(f"#{i} {step.title} ({' '.join(step.args)})")
        if not records:
            out.append("(no records)\n")
            continue
        tables = compare_records(records, baseline=plan.baseline or None, metrics=plan.metrics or None)
        for table in tables:
            out.append(format_table(table))
            line = _verdict(table, plan.metrics)
            if line:
                out.append(line + "\n")
    return "\n".join(out)


def _verdict(table, metrics: list[str]) -> str:
    """``adaptra 2.33x, adaptra_cpu 1.63x, 1f1b 0.93x better than zb on iteration_time_s
    (simulated)``: the first plan metric the table has, when it has a baseline."""
    from bench.compare import format_ratio

    if not table.has_ratios:
        return ""
    metric = next((m for m in metrics or table.metrics if m in table.metrics), None)
    if metric is None:
        return ""
    rows = [r for r in table.rows if r.system != table.baseline and r.cells.get(metric) is not None
            and r.cells[metric].ratio is not None]
    if not rows:
        return ""
    rows.sort(key=lambda r: -r.cells[metric].ratio)
    parts = ", ".join(f"{r.system} {format_ratio(r.cells[metric])}" for r in rows)
    word = {"sim": "simulated", "real": "measured"}.get(table.key.mode, table.key.mode)
    return f"=> {parts} better than {table.baseline} on {metric} ({word})"


def _safe_load(results_dir: str) -> list[dict]:
    from bench.record import load_records

    try:
        return load_records(results_dir)
    except FileNotFoundError:
        return []
