"""Hydra callback: after a multirun, print the side-by-side table of the sweep's records."""
from __future__ import annotations

import importlib
import pathlib
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
        if not records:
            return
        print()
        print(format_table(compare_records(records, baseline=config.get("baseline_system") or None)))
        if config.get("figure"):
            draw_figure(str(config.figure), records, pathlib.Path(sweep))


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
