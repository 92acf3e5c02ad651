"""Knobs only real mode reads (``system.real.*``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class HotSPaRealKnobs:
    # Run these policies interleaved in one job (one step each per round, the order rotating
    # every round) on the same mini-batches, and report each one's median: the fair comparison
    # on a shared machine. Empty = this policy only.
    interleave: List[str] = field(default_factory=list)
    # Check the first ``check_steps`` steps (0 = every step) of every policy against a
    # single-process reference: the loss, every gradient and the parameters after Adam. The
    # checks run outside the timed window.
    check_grads: bool = True
    check_steps: int = 1
    grad_rtol: float = 1e-5
    # Micro-batch capacity of a strategy = tokens_per_tp * tp * pp (the real CPU experiment: DP2 holds 1024
    # tokens per micro-batch, TP2 2048), the CPU stand-in for the memory model's maxlen.
    tokens_per_tp: int = 1024
    timeout_s: float = 600.0
