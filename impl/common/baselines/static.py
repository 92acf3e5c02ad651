"""The static baselines' grid search (Megatron-like: TP; DeepSpeed-like: Ulysses SP), as HotSPa
(``megatron_static``, ``deepspeed_static``) and Hydraulis (``megatron_like``, ``deepspeed_like``)
run it: one layout for the whole run, the one with the fastest mean priced step over the planning
steps. Which layouts are tried and how a step is priced are the paper's cost model's (handed in);
the selection rule is this one.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Optional, Sequence, TypeVar

from impl.common.errors import ConfigError

L = TypeVar("L")
PARALLELS = ("tp", "ulysses")


@dataclass(frozen=True)
class StaticGridConfig:
    """``parallel``: how a layout splits a sequence (tp = Megatron TP + SP, ulysses = DeepSpeed
    Ulysses SP); ``max_tp``: the largest TP/SP degree tried (the two papers differ: HotSPa's
    baseline stays inside a node, 8; Hydraulis' spans two, 16, the only way its 32B model holds 32K
    tokens without CP); ``field``: the knob that set ``max_tp``, named in errors."""

    parallel: str = "tp"
    max_tp: int = 8
    field: str = "system.sim.static_max_tp"

    def __post_init__(self):
        if self.parallel not in PARALLELS:
            raise ConfigError(f"system.parallel: unknown {self.parallel!r} (one of: {', '.join(PARALLELS)})")
        if self.max_tp < 1:
            raise ConfigError(f"{self.field}: must be >= 1, got {self.max_tp}")


def mean_step_s(price: Callable[[object], float], sample: Sequence) -> float:
    """The mean priced step over the planning steps (an exact sum, then one division)."""
    return statistics.fmean(price(b) for b in sample)


def fastest(layouts: Iterable[tuple[Hashable, L]], score: Callable[[L], float]
            ) -> tuple[Optional[L], dict]:
    """The layout of the lowest score among ``(key, layout)`` pairs, ties to the earlier one
    (callers order the layouts so that earlier = smaller), and every score by key; (None, {})
    when there is none."""
    best, scores = None, {}
    for key, lay in layouts:
        scores[key] = s = score(lay)
        if best is None or s < best[0]:
            best = (s, lay)
    return (best[1] if best else None), scores
