"""Typed fault specs. Each fault yaml names its ``kind``; validation picks the dataclass."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class NoFault:
    kind: str = "none"


@dataclass
class DelayEvent:
    """One segment of a time-varying delay trace: from ``start_iter`` (inclusive) on."""

    start_iter: int = 0
    links: List[List[int]] = field(default_factory=list)
    delay_s: float = 0.0


@dataclass
class LinkDelay:
    """Extra per-message latency on pipeline links (i, i+1)."""

    kind: str = "link_delay"
    links: List[List[int]] = field(default_factory=lambda: [[0, 1]])
    delay_s: float = 0.0
    start_iter: int = 0
    stop_iter: Optional[int] = None
    # Optional time-varying trace; when non-empty it replaces links/delay_s.
    trace: List[DelayEvent] = field(default_factory=list)
    # 'oracle': the scheduler is told the delays; 'measured': per-link timers + change detection.
    detection: str = "oracle"


@dataclass
class ComputeSlowdown:
    kind: str = "compute_slowdown"
    gpus: List[int] = field(default_factory=list)
    factor: float = 1.0
    start_iter: int = 0
    stop_iter: Optional[int] = None


@dataclass
class RankKill:
    """Kill a worker at an iteration (the job must record the failure, not hang)."""

    kind: str = "rank_kill"
    rank: int = 0
    at_iter: int = 0


KINDS = {
    "none": NoFault,
    "link_delay": LinkDelay,
    "compute_slowdown": ComputeSlowdown,
    "rank_kill": RankKill,
}
