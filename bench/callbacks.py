"""Hydra callback: after a multirun, print the side-by-side table of the sweep's records."""
from __future__ import annotations

import importlib
import os
import pathlib
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


# Jobs of the last multirun in this process that did not end ok (read by bench.app.main).
SWEEP_FAILURES: list[str] = []


class CompareOnMultirunEnd(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from bench.compare import compare_records, format_table
        from bench.record import load_records

        sweep = str(config.hydra.sweep.dir)
        try:
            records = [r for r in load_records(config.results_dir) if r.get("sweep") == sweep]
        except Exception as exc:  # a comparison failure must not turn a finished sweep into an error
            print(f"mlsys-bench: could not read records for the comparison: {exc}")
            return
        # A job its system refused in preflight (record.not_applicable) is an answer, not a failure.
        SWEEP_FAILURES[:] = [f"{r['system']}: {r['error']}" for r in records
                             if r["status"] == "failed" and not r.get("not_applicable")]
        if not records or os.environ.get("MLSYS_BENCH_NO_SWEEP_TABLE"):
            return
        print()
        print(format_table(compare_records(records, baseline=config.get("baseline_system") or None)))
        if config.get("figure"):
            draw_figure(str(config.figure), records, pathlib.Path(sweep))
        n_na = sum(1 for r in records if r.get("not_applicable"))
        if n_na:
            print(f"mlsys-bench: {n_na} of {len(records)} jobs not applicable (refused in preflight; records kept)")
        if SWEEP_FAILURES:
            print(f"mlsys-bench: {len(SWEEP_FAILURES)} of {len(records)} jobs failed (records kept, status failed)")
            for r in records:
                if r["status"] == "failed" and r.get("error_log"):
                    print(f"  {r['system']}: traceback in {r['error_log']}")


def draw_figure(target: str, records: list[dict], out_dir: pathlib.Path) -> None:
    module, _, func = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module), func)
        paths = fn(records, out_dir)
    except Exception as exc:  # a figure failure must not turn a finished sweep into an error
        print(f"mlsys-bench: figure {target} failed: {type(exc).__name__}: {exc}")
        return
    for path in paths or []:
        print(f"figure: {path}")
