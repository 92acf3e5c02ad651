"""What `mlsys-bench` runs with no arguments: the steps of ``conf/default_plan.yaml``.

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
    text = resources.files("conf").joinpath("default_plan.yaml").read_text()
    merged = OmegaConf.merge(OmegaConf.structured(DefaultPlan), OmegaConf.create(text))
    return OmegaConf.to_object(merged)


def run_default_plan() -> int:
    from bench.compare import compare_records, format_table
    from bench.record import load_records

    plan = load_plan()
    before = {r["run_id"] for r in _safe_load(plan.results_dir)}
    failures = 0
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
    new = [r for r in _safe_load(plan.results_dir) if r["run_id"] not in before]
    if new:
        print()
        print(format_table(compare_records(new, baseline=plan.baseline or None, metrics=plan.metrics or None)))
    print(f"\nrecords: {plan.results_dir}/records.jsonl  (compare again: mlsys-bench-compare --results {plan.results_dir})")
    return 1 if failures else 0


def _safe_load(results_dir: str) -> list[dict]:
    from bench.record import load_records

    try:
        return load_records(results_dir)
    except FileNotFoundError:
        return []
