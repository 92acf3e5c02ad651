from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DemoWorkload:
    """Placeholder workload for jobs that need none (e.g. calibration)."""

    kind: str = "demo"
    iterations: int = 1
