"""Plans of the baselines, each a function of the rates it reacts to. The paper names no
baselines; these are our choice [R] (impl/malleus/README.md, "Reconstructed choices").

- ``uniform`` (B1, Megatron-style): the nominal layout, no reaction.
- ``data_only`` (B4, Falcon-like): uniform groups and layers; micro-batches by ILP-B (the
  integer optimum of m_i proportional to 1/z_i).
- ``layers_only`` (B5): uniform groups and micro-batches; layers per pipeline by ILP-A.
- ``restart_exclude`` (B3): drop every node holding a GPU with x >= 1.2, relaunch the best
  homogeneous layout on the rest (the restart cost is charged by the system).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from impl.common.api import ConfigError
from impl.common.parallel.cost import HybridCostModel, iteration_cost
from impl.common.parallel.ilp import ilp_a, ilp_b
from impl.common.parallel.plan import Group, Plan, PipelinePlan, PlanError, effective_rate, group_rates, uniform_plan
from impl.common.parallel.planner import PlannerConfig


def uniform(cfg: PlannerConfig, x: Sequence[float]) -> Plan:
    return cfg.uniform()


def data_only(cfg: PlannerConfig, x: Sequence[float]) -> Plan:
    base = cfg.uniform()
    y = group_rates(base, x, cfg.alpha, cfg.healthy_below)
    zs = [max(y[g] * n for g, n in zip(p.groups, p.layers)) for p in base.pipelines]
    res = ilp_b(zs, [p.num_stages for p in base.pipelines], cfg.num_microbatches, cfg.solver_b)
    pipes = tuple(PipelinePlan(p.groups, p.layers, m) for p, m in zip(base.pipelines, res[1]))
    return Plan(base.num_gpus, base.gpus_per_node, base.tp, base.num_layers, base.num_microbatches, base.groups,
                pipes, (), "data_only")


def layers_only(cfg: PlannerConfig, x: Sequence[float]) -> Plan:
    base = cfg.uniform()
    y = group_rates(base, x, cfg.alpha, cfg.healthy_below)
    pipes = []
    for p in base.pipelines:
        res = ilp_a([y[g] for g in p.groups], [1.0] * p.num_stages, cfg.num_layers, cfg.memory, cfg.solver_a)
        layers = res[1] if res is not None else p.layers
        if min(layers) == 0:  # a stage cannot be dropped without regrouping: keep >= 1 layer
            layers = _at_least_one(layers)
        pipes.append(PipelinePlan(p.groups, tuple(layers), p.micro_batches))
    return Plan(base.num_gpus, base.gpus_per_node, base.tp, base.num_layers, base.num_microbatches, base.groups,
                tuple(pipes), (), "layers_only")


def _at_least_one(layers: Sequence[int]) -> tuple[int, ...]:
    out = list(layers)
    for j, n in enumerate(out):
        if n == 0:
            k = max(range(len(out)), key=lambda i: (out[i], -i))
            out[k] -= 1
            out[j] = 1
    return tuple(out)


def restart_exclude(cfg: PlannerConfig, x: Sequence[float], cm: Optional[HybridCostModel]) -> Plan:
    gpn = cfg.gpus_per_node
    bad = {g // gpn for g, v in enumerate(x) if effective_rate(v, cfg.healthy_below) > 1.0}
    keep = [n for n in range(cfg.num_nodes) if n not in bad]
    if not bad:
        return cfg.uniform()
    if not keep:
        return cfg.uniform().with_label("restart_exclude (no healthy node: unchanged)")
    devs = [n * gpn + i for n in keep for i in range(gpn)]
    N = len(devs)
    best, best_t = None, math.inf
    tp = 1
    while tp <= gpn:
        for pp in range(1, cfg.num_layers + 1):
            if N % (tp * pp):
                continue
            dp = N // (tp * pp)
            if cfg.num_microbatches < dp * pp:
                continue
            try:
                p = uniform_plan(N, gpn, dp, tp, pp, cfg.num_layers, cfg.num_microbatches)
            except (PlanError, ConfigError):  # this (dp, tp, pp) cannot lay out: skip it
                continue
            if cfg.memory is not None:
                ratio = cfg.tp / tp
                if not all(cfg.memory.fits(pp, j, n, ratio) for j, n in enumerate(p.pipelines[0].layers)):
                    continue
            mapped = _remap(p, devs, cfg)
            t = iteration_cost(mapped, [1.0] * cfg.num_gpus, _with_tp(cm, tp)).iteration_time_s if cm else float(dp * pp)
            if t < best_t - 1e-12:
                best, best_t = mapped, t
        tp *= 2
    if best is None:
        return cfg.uniform().with_label("restart_exclude (no layout fits: unchanged)")
    return best


def _with_tp(cm: HybridCostModel, tp: int) -> HybridCostModel:
    from dataclasses import replace

    return replace(cm, tp=tp)


def _remap(p: Plan, devs: list[int], cfg: PlannerConfig) -> Plan:
    gpn = cfg.gpus_per_node
    groups = tuple(Group(tuple(devs[g] for g in grp.gpus), devs[grp.gpus[0]] // gpn) for grp in p.groups)
    used = {d for g in groups for d in g.gpus}
    susp = tuple(d for d in range(cfg.num_gpus) if d not in used)
    # tp of the plan is the relaunched layout's (its groups are full at that degree)
    return Plan(cfg.num_gpus, gpn, p.tp, p.num_layers, p.num_microbatches, groups, p.pipelines, susp, "restart_exclude")
