"""A (dp, tp, pp) triple as data: HotSPa's per-group strategies and Hydraulis' optimizer layout."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"({self.dp},{self.tp},{self.pp})"
