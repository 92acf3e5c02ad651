"""Hydra callback: after a multirun, print the side-by-side table of the sweep's records."""
from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


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
        if records:
            print()
            print(format_table(compare_records(records)))
