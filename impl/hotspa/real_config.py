"""Knobs only real mode reads (``system.real.*``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class RealKnobs:
    # Run these policies interleaved in one job (one step each per round) and report each
    # one's median: the fair comparison on a shared machine. Empty = this policy only.
    interleave: List[str] = field(default_factory=list)
    # Check every step's loss and gradients against the single-process reference.
    check_grads: bool = True
    grad_rtol: float = 1e-5
    timeout_s: float = 600.0
