"""The logger contract and its no-op implementation (``logger=none``); see :mod:`bench.loggers`."""
from __future__ import annotations

import pathlib


class LoggerError(ValueError):
    """Bad logger settings; the message is one line naming the field."""


class JobLogger:
    """The ``logger=none`` logger: every call is a no-op and there is nothing to record."""

    def start(self, *, run_id: str, experiment: str, system: str, mode: str, hardware: str,
              fault: str, workload: str, config: dict) -> None:
        return None

    def log_result(self, metrics: dict[str, dict], artifacts: list[pathlib.Path],
                   status: str) -> None:
        return None

    def finish(self) -> dict | None:
        return None
