"""Per-job loggers: W&B for browsing, or nothing. The local record stays the source of truth.

The runner calls, per job: ``start(...)`` before the system runs, ``log_result(...)`` once it
has the metrics, then ``finish()``, whose return value goes into the record's ``wandb`` field.
"""
from __future__ import annotations

import pathlib
from typing import Any

from bench.loggers.base import JobLogger, LoggerError


def make_logger(cfg: Any, out_dir: pathlib.Path) -> JobLogger:
    """Build the logger ``cfg`` (a LoggerConfig or its DictConfig) names, for one job."""
    name = getattr(cfg, "name", "none") or "none"
    if name == "none":
        return JobLogger()
    if name == "wandb":
        # Imported here so that logger=none never pays for importing wandb.
        from bench.loggers.wandb_logger import WandbLogger

        return WandbLogger(cfg, pathlib.Path(out_dir))
    raise LoggerError(f"logger.name: {name!r} is not a logger (expected none or wandb)")


__all__ = ["JobLogger", "LoggerError", "make_logger"]
