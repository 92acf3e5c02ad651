"""Layouts after a loss: what each system trains on.

- ``heterogeneous`` (ours): the shared planner (:func:`impl.common.parallel.planner.plan`)
  on every surviving GPU: TP groups per node split into powers of two, ILP layer and
  micro-batch splits, plans re-scored by the iteration cost model.
- ``rectangular`` (DCP, UCP): the best homogeneous DP x TP x PP mesh (a DeviceMesh is
  rectangular) over the surviving GPUs, TP groups inside a node, layers split evenly,
  memory-checked; the fastest by the same cost model.
- ``node-granular`` (restart_all, Gemini-like): as rectangular, on whole healthy nodes only
  (a node with a dead GPU is out until repaired).
None when nothing fits: the system idles until repair.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

from impl.common.api import ConfigError
from impl.common.parallel.cost import HybridCostModel, StageMemoryRows, iteration_cost
from impl.common.parallel.plan import Group, PipelinePlan, Plan, even_split
from impl.common.parallel.planner import PlannerConfig, PlannerError, plan as plan_heterogeneous

GRANULARITIES = ("gpu_heterogeneous", "gpu_rectangular", "node_rectangular")


def step_time_s(p: Plan, cm: HybridCostModel) -> float:
    """Iteration time of a plan (its own TP degree priced by the cost model)."""
    return iteration_cost(p, [1.0] * p.num_gpus, replace(cm, tp=p.tp) if p.tp != cm.tp else cm).iteration_time_s


def heterogeneous(cfg: PlannerConfig, cm: HybridCostModel, lost: Sequence[int]) -> Optional[Plan]:
    x = [1.0] * cfg.num_gpus
    try:
        res = plan_heterogeneous(cfg, x, cost_fn=lambda p: iteration_cost(p, x, cm).iteration_time_s,
                                 unavailable=sorted(lost), label="replanned")
    except PlannerError:
        return None
    return res.plan


def rectangular(cfg: PlannerConfig, cm: HybridCostModel, lost: Sequence[int], whole_nodes: bool) -> Optional[Plan]:
    """The fastest homogeneous layout on the survivors (whole healthy nodes if ``whole_nodes``)."""
    gpn, dead = cfg.gpus_per_node, set(lost)
    alive = {n: [g for g in range(n * gpn, (n + 1) * gpn) if g not in dead] for n in range(cfg.num_nodes)}
    if whole_nodes:
        alive = {n: gs for n, gs in alive.items() if len(gs) == gpn}
    best, best_t = None, math.inf
    tp = 1
    while tp <= gpn:
        groups = [Group(tuple(gs[i * tp:(i + 1) * tp]), n) for n, gs in sorted(alive.items()) for i in range(len(gs) // tp)]
        for pp in range(1, min(cfg.num_layers, len(groups)) + 1):
            dp = len(groups) // pp
            if dp < 1 or cfg.num_microbatches < dp * pp:
                continue
            layers = even_split(cfg.num_layers, pp)
            if cfg.memory is not None and not _fits(cfg.memory, layers, cfg.tp / tp):
                continue
            p = _mesh(cfg, groups[:dp * pp], dp, pp, tp, layers, dead)
            t = step_time_s(p, cm)
            if t < best_t - 1e-12:
                best, best_t = p, t
        tp *= 2
    return best


def _fits(mem: StageMemoryRows, layers: Sequence[int], ratio: float) -> bool:
    return all(mem.fits(len(layers), j, n, ratio) for j, n in enumerate(layers))


def _mesh(cfg: PlannerConfig, groups: list[Group], dp: int, pp: int, tp: int, layers, dead) -> Plan:
    """Megatron order over the chosen groups: stage p of pipeline d is group p*dp + d."""
    ms = even_split(cfg.num_microbatches, dp)
    pipes = tuple(PipelinePlan(tuple(p * dp + d for p in range(pp)), tuple(layers), ms[d]) for d in range(dp))
    used = {g for grp in groups for g in grp.gpus}
    susp = tuple(g for g in range(cfg.num_gpus) if g not in used)
    return Plan(cfg.num_gpus, cfg.gpus_per_node, tp, cfg.num_layers, cfg.num_microbatches, tuple(groups), pipes,
                susp, f"rectangular dp{dp} tp{tp} pp{pp}")


def after_loss(granularity: str, cfg: PlannerConfig, cm: HybridCostModel, lost: Sequence[int]) -> Optional[Plan]:
    """The layout a system of this granularity trains on with ``lost`` GPUs gone."""
    if not lost:
        return cfg.uniform()
    if granularity == "gpu_heterogeneous":
        return heterogeneous(cfg, cm, lost)
    if granularity == "gpu_rectangular":
        return rectangular(cfg, cm, lost, whole_nodes=False)
    if granularity == "node_rectangular":
        return rectangular(cfg, cm, lost, whole_nodes=True)
    raise ConfigError(f"granularity: unknown {granularity!r} (one of: {', '.join(GRANULARITIES)})")


def describe(p: Optional[Plan]) -> str:
    if p is None:
        return "idle until repair (no layout fits)"
    pipes: list[list] = []  # [text, count] of runs of identical pipelines
    for pl in p.pipelines:
        text = "[" + " | ".join(f"TP{p.groups[g].size}x{n}L" for g, n in zip(pl.groups, pl.layers)) + f"] m={pl.micro_batches}"
        if pipes and pipes[-1][0] == text:
            pipes[-1][1] += 1
        else:
            pipes.append([text, 1])
    return f"{len(p.active_gpus)} GPUs: " + " ".join(t if n == 1 else f"{n}x {t}" for t, n in pipes)
