"""Malleus and its baselines as registered policies: what each plans on a change of the rates,
whether it reacts at all, and how a new plan is applied (live migration or checkpoint-restart).

The restart baseline plans with one of :data:`RESTART_PLANS` (``system.restart_plan``): B3 drops
the straggling nodes; the ablation applies Malleus's own plan by restart instead of migration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from impl.common.parallel.cost import HybridCostModel
from impl.common.parallel.plan import Plan
from impl.common.parallel.planner import PlannerConfig, plan as hetero_plan
from impl.common.registry import Registry

from . import baselines

CostFn = Optional[Callable[[Plan], float]]
PlanFn = Callable[[PlannerConfig, Sequence[float], Plan, CostFn, Optional[HybridCostModel]], "tuple[Plan, dict]"]


def _malleus(pcfg: PlannerConfig, x, old: Plan, cost_fn: CostFn, cm) -> tuple[Plan, dict]:
    res = hetero_plan(pcfg, x, old_plan=old, cost_fn=cost_fn, label="malleus")
    return res.plan, {"z": res.z, "stats": res.stats,
                      "candidates": [{"z": c.z, "cost_s": c.cost_s} for c in res.candidates]}


def _baseline(fn) -> PlanFn:
    return lambda pcfg, x, old, cost_fn, cm: (fn(pcfg, x), {})


RESTART_PLANS: Registry[PlanFn] = Registry("value", "system.restart_plan")
RESTART_PLANS.add("exclude", lambda pcfg, x, old, cost_fn, cm: (baselines.restart_exclude(pcfg, x, cm), {}))
RESTART_PLANS.add("malleus", _malleus)


@dataclass(frozen=True)
class MalleusPolicy:
    # None: the plan of system.restart_plan (the restart baseline's two variants)
    planner: Optional[PlanFn]
    # False: keeps the nominal layout, so nothing is observed or replanned
    react: bool = True
    # True: a new plan costs a checkpoint-restart (sim only) instead of a live migration
    by_restart: bool = False

    def plan_fn(self, restart_plan: str) -> PlanFn:
        return self.planner if self.planner is not None else RESTART_PLANS.get(restart_plan)

    def runs_planner(self, restart_plan: str) -> bool:
        """Whether its plans come from the heterogeneity-aware planner (whose feasibility the
        preflight checks at every change of the fault)."""
        return self.plan_fn(restart_plan) is _malleus


POLICIES: Registry[MalleusPolicy] = Registry("policy")
POLICIES.add("malleus", MalleusPolicy(_malleus))
POLICIES.add("uniform", MalleusPolicy(_baseline(baselines.uniform), react=False))
POLICIES.add("data_only", MalleusPolicy(_baseline(baselines.data_only)))
POLICIES.add("layers_only", MalleusPolicy(_baseline(baselines.layers_only)))
POLICIES.add("restart_replan", MalleusPolicy(None, by_restart=True))
