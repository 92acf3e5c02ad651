"""A parallel strategy (dp, tp, pp) as data, and the group plan of one HotSPa step: descending
length boundaries with one strategy per group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from impl.common.api import ConfigError
from impl.common.parallel.dims import ParallelDims
from impl.common.varlen.packing import check_boundaries


Strategy = ParallelDims  # one strategy per length group


def parse_strategy(value: Sequence[int], num_gpus: int, field: str) -> Strategy:
    """``[dp, tp, pp]`` -> Strategy; one-line errors name the field and the numbers."""
    if len(value) != 3 or any(int(v) != v or v < 1 for v in value):
        raise ConfigError(f"{field}: a strategy is [dp, tp, pp] of integers >= 1, got {list(value)}")
    s = Strategy(*(int(v) for v in value))
    if s.gpus != num_gpus:
        raise ConfigError(f"{field}: dp*tp*pp = {s.dp}*{s.tp}*{s.pp} = {s.gpus} != workload.num_gpus {num_gpus}")
    return s


@dataclass(frozen=True)
class GroupPlan:
    """Group g holds lengths in (boundaries[g+1], boundaries[g]] and runs ``strategies[g]``;
    group 0 (the longest) is the home layout (optimizer states live there)."""

    boundaries: tuple[int, ...]  # descending, last is 0
    strategies: tuple[Strategy, ...]  # one per group, longest group first

    @property
    def home(self) -> Strategy:
        return self.strategies[0]


def make_group_plan(boundaries: Sequence[int], strategies: Sequence[Sequence[int]], num_gpus: int,
                    field: str = "system") -> GroupPlan:
    b = check_boundaries(list(boundaries), field=f"{field}.boundaries")
    if len(strategies) != len(b) - 1:
        raise ConfigError(f"{field}.strategies: {len(strategies)} strategies for {len(b) - 1} groups "
                          f"(boundaries {list(b)})")
    ss = tuple(parse_strategy(s, num_gpus, f"{field}.strategies[{i}]") for i, s in enumerate(strategies))
    return GroupPlan(tuple(b), ss)
