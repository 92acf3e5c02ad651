"""Layouts after a loss: this system's heterogeneous re-plan on the survivors (after the
authors' code, PKU-DAIR/Hetu PR #9) with the shared planner (:mod:`impl.common.parallel.planner`: TP groups per node in
powers of two, ILP over layers per pipeline, ILP over micro-batches with the global batch
unchanged), and the baselines' best homogeneous fit (a DeviceMesh is rectangular: one TP
degree, equal layers per stage). Both respect a per-rank memory budget on the exact bytes of
state each rank would hold."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from impl.common.api import ConfigError
from impl.common.checkpoint.layout import StagePlan, TensorMeta, format_layout, pipeline_layout
from impl.common.parallel.planner import PlannerConfig, plan as run_planner


@dataclass(frozen=True)
class Cluster:
    """The nominal job: ``num_gpus`` ranks in nodes of ``gpus_per_node``, one pipeline TP x PP."""

    num_gpus: int
    gpus_per_node: int
    tp: int
    pp: int
    num_layers: int
    micro_batches: int
    alpha: tuple = (1.0, 2.0, 4.0, 8.0)
    mem_budget: float = 0.6  # per-rank state / whole state


@dataclass(frozen=True)
class Relayout:
    stages: tuple  # StagePlan per stage, ranks renumbered 0..n-1
    micro_batches: int
    device_of: tuple  # new rank -> old rank (GPU)
    t_plan_s: float
    how: str
    max_rank_state: float  # largest per-rank share of the whole state

    @property
    def world(self) -> int:
        return sum(len(s.ranks) for s in self.stages)

    def describe(self) -> str:
        return format_layout([list(self.stages)])


def uniform_stages(tp: int, pp: int, num_layers: int) -> tuple:
    if num_layers % pp:
        raise ConfigError(f"workload.pp: {pp} does not divide model.num_layers {num_layers}")
    n = num_layers // pp
    return tuple(StagePlan(tuple(range(j * tp, (j + 1) * tp)), (j * n, (j + 1) * n)) for j in range(pp))


def rank_shares(metas: Sequence[TensorMeta], stages, num_layers: int) -> dict[int, float]:
    """Each rank's bytes of state under ``stages`` / the whole state's bytes."""
    lay = pipeline_layout(metas, [list(stages)], num_layers)
    by = {m.name: m for m in metas}
    total = sum(m.nbytes for m in metas)
    return {r: sum(by[k].nbytes // (g if by[k].dim is not None else 1) for k, (_, g) in own.items()) / total
            for r, own in lay.ranks.items()}


def _check_budget(metas, stages, c: Cluster, what: str) -> float:
    worst = max(rank_shares(metas, stages, c.num_layers).values())
    if worst > c.mem_budget + 1e-12:
        raise ConfigError(f"real.mem_budget: {what} {format_layout([list(stages)])} puts {worst:.2f} of the state on "
                          f"one rank, over the budget {c.mem_budget}")
    return worst


def replan(c: Cluster, lost: Sequence[int], metas: Sequence[TensorMeta]) -> Relayout:
    """This system: the planner's best plan on the survivors, ranks renumbered in stage order."""
    t0 = time.perf_counter()
    cfg = PlannerConfig(num_gpus=c.num_gpus, gpus_per_node=c.gpus_per_node, dp=1, tp=c.tp, pp=c.pp,
                        num_layers=c.num_layers, num_microbatches=c.micro_batches, alpha=tuple(c.alpha),
                        solver_a="highs", solver_b="highs")
    res = run_planner(cfg, [1.0] * c.num_gpus, unavailable=list(lost), label="recovered")
    t_plan = time.perf_counter() - t0
    p = res.plan
    if len(p.pipelines) != 1:
        raise ConfigError(f"replan: the real trainer runs one pipeline, the plan has {len(p.pipelines)}")
    pipe = p.pipelines[0]
    stages, device_of, nxt = [], [], 0
    for gid, (lo, hi) in zip(pipe.groups, pipe.layer_ranges()):
        gpus = p.groups[gid].gpus
        stages.append(StagePlan(tuple(range(nxt, nxt + len(gpus))), (lo, hi)))
        device_of += list(gpus)
        nxt += len(gpus)
    stages = tuple(stages)
    worst = _check_budget(metas, stages, c, "the re-planned layout")
    return Relayout(stages, pipe.micro_batches, tuple(device_of), t_plan, "replan", worst)


def homogeneous(c: Cluster, lost: Sequence[int], metas: Sequence[TensorMeta], heads: int) -> Relayout:
    """Baselines: the most ranks a rectangular pp x tp mesh of equal stages can use within the
    budget (ties: the larger TP degree, as the nominal mesh)."""
    t0 = time.perf_counter()
    alive = [g for g in range(c.num_gpus) if g not in set(lost)]
    best = None
    tp = c.tp
    while tp >= 1:
        for pp in range(1, c.num_layers + 1):
            if c.num_layers % pp or heads % tp or tp * pp > len(alive):
                continue
            stages = uniform_stages(tp, pp, c.num_layers)
            worst = max(rank_shares(metas, stages, c.num_layers).values())
            if worst > c.mem_budget + 1e-12:
                continue
            key = (tp * pp, tp)
            if best is None or key > best[0]:
                best = (key, stages, worst)
        tp //= 2
    if best is None:
        raise ConfigError(f"real.mem_budget: no homogeneous layout of {len(alive)} survivors fits the budget {c.mem_budget}")
    _, stages, worst = best
    n = sum(len(s.ranks) for s in stages)
    return Relayout(stages, c.micro_batches, tuple(alive[:n]), time.perf_counter() - t0, "homogeneous", worst)


def same(c: Cluster, metas: Sequence[TensorMeta]) -> Relayout:
    """A replacement took the lost rank's place (repair): the nominal layout again."""
    stages = uniform_stages(c.tp, c.pp, c.num_layers)
    return Relayout(stages, c.micro_batches, tuple(range(c.num_gpus)), 0.0, "same",
                    max(rank_shares(metas, stages, c.num_layers).values()))
