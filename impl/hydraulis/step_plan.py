"""Hydraulis per-step planning (the authors' planner, Hetu
``examples/hydraulis/strategy/new_dynamic.py``): for each candidate replica list, stage 1
dispatch (:mod:`.dispatch`) then stage 2 packing per replica (:mod:`.packing`, which minimises
the authors' packing score); the candidate whose packing has the smallest predicted step, the
max-over-replicas 1F1B time (the price the simulator charges, :mod:`impl.hydraulis.cost.step`),
wins. [R] The authors rank candidates by the packing score ``(z + c)(pp − 1 + v)`` itself, an
upper bound of that time (every micro-batch as long as the longest): ranked by it, a layout of
few even micro-batches beats a faster one of many uneven ones, so the planner chose with other
prices than the step is charged (README "Step price").

- Candidates whose largest capacity is below the longest sequence are dropped; if none is
  left the pool cannot hold the batch: one-line :class:`ConfigError`.
- A candidate whose dispatch leaves a replica empty is dropped (infeasible in the authors' code
  too), never run with an idle replica.
- Exact shortcuts [R]: a candidate whose replica time bound (:func:`.packing.time_lower_bound`)
  already reaches the best predicted time so far is pruned, replicas are packed highest bound first, and with ``ilp_scope="critical"`` a
  replica that cannot be the slowest keeps its LPT packing (see :data:`ILP_SCOPES`).
- ``predicted_ms`` is the 1F1B time of the winner, ``max_r (Σ_j T_mb,j + (pp_r − 1)·max_j T_mb,j)``
  with ``T_mb = Σ_i seq_cost(s_i) + c``, recomputed from the assignment.
A plan is plain data: :meth:`StepPlan.to_dict` prints/saves it, :func:`check_plan` validates it.
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from impl.common.api import ConfigError

from impl.hydraulis.cost.strategy import ReplicaCost, fmt_strategy
from impl.hydraulis.dispatch import DEFAULT_BUDGET, dispatch, token_balanced
from impl.hydraulis.packing import Packing, PackingInfeasible, pack_replica, packing_score, time_lower_bound

DISPATCHES = ("greedy", "token_balanced")
# ILPs for every replica (the authors' code) or only where they can move the candidate's max
# score ("critical": a replica whose LPT packing already scores below the candidate's slowest
# replica keeps it; exact for the candidate's score, so the winner is unchanged).
class IlpScope(enum.StrEnum):
    """Which replicas stage 2 packs by ILP: the ones that can be the slowest (critical), or all."""

    critical = "critical"
    all = "all"


ILP_SCOPES = tuple(IlpScope)


@dataclass(frozen=True)
class ReplicaPlan:
    replica: ReplicaCost
    micro_batches: list  # list[list[int]] sequence indices, run in this order (largest first)
    score: float  # ms, (z + c)(pp − 1 + v)
    time_ms: float = 0.0  # 1F1B time
    status: str = "optimal"
    lower_bound: float = 0.0


@dataclass
class StepPlan:
    candidate: int
    replicas: list  # list[ReplicaPlan], in the candidate's replica order
    predicted_ms: float
    plan_time_s: float
    score: float = 0.0  # max_r packing score of the winner
    # per candidate: its predicted time in ms (ok), a lower bound on it (pruned) or inf (dropped)
    candidate_scores: list = field(default_factory=list)
    statuses: dict = field(default_factory=dict)  # ILP status -> count over the winner's replicas
    ilp_solves: int = 0  # over every candidate
    outcomes: list = field(default_factory=list)  # per candidate: ok | no_fit | empty_replica | no_pack | pruned

    def to_dict(self) -> dict:
        return {"candidate": self.candidate, "strategy": fmt_strategy([r.replica for r in self.replicas]),
                "predicted_ms": self.predicted_ms, "score": self.score, "plan_time_s": self.plan_time_s,
                "candidate_scores": self.candidate_scores, "outcomes": self.outcomes, "statuses": self.statuses,
                "replicas": [{"tp": r.replica.tp, "pp": r.replica.pp, "score": r.score, "time_ms": r.time_ms,
                              "status": r.status, "micro_batches": r.micro_batches} for r in self.replicas]}


def replica_time_ms(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], replica: ReplicaCost) -> float:
    return replica.replica_time([[lengths[i] for i in mb] for mb in micro_batches])


def _check_inputs(lengths: Sequence[int], candidates: Sequence[Sequence[ReplicaCost]]) -> int:
    if not len(lengths):
        raise ConfigError("plan_step: the batch has no sequences")
    if min(lengths) < 1:
        raise ConfigError(f"plan_step: sequence lengths must be >= 1, got {min(lengths)}")
    if not candidates or any(not c for c in candidates):
        raise ConfigError("strategy pool: empty (or a candidate with no replicas)")
    longest = int(max(lengths))
    best_cap = max(max(r.cap for r in c) for c in candidates)
    if best_cap < longest:
        raise ConfigError(f"strategy pool: no candidate holds the longest sequence ({longest} tokens > "
                          f"largest replica capacity {best_cap})")
    return longest


def plan_candidate(lengths: Sequence[int], replicas: Sequence[ReplicaCost], *, shuffles: int = 100, seed: int = 0,
                   v_window: int = 16, time_limit_s: float = 0.5, node_limit: Optional[int] = None,
                   mip_rel_gap: float = 0.0, dispatch_rule: str = "greedy", includes_c: bool = True,
                   cutoff: float = math.inf, ilp_scope: str = "critical",
                   refine: bool = True, budget: int = DEFAULT_BUDGET) -> tuple[Optional[list], float, int, str]:
    """(replica plans or None, predicted time in ms, ILP solves, outcome) of one candidate; the
    predicted time is the max over replicas of the packing's 1F1B time. Outcome: ``ok``;
    ``no_fit`` (capacity below the longest sequence); ``empty_replica`` (dispatch leaves a
    replica without data: dropped); ``no_pack`` (a replica's share packs into no micro-batch count of
    its v window: dropped); ``pruned`` (its time provably cannot go below ``cutoff``,
    the best candidate so far: the returned time is that lower bound)."""
    if max(r.cap for r in replicas) < max(lengths):
        return None, math.inf, 0, "no_fit"
    if dispatch_rule == "greedy":
        d = dispatch(lengths, replicas, shuffles=shuffles, seed=seed, includes_c=includes_c, refine=refine,
                     budget=budget)
    elif dispatch_rule == "token_balanced":
        d = token_balanced(lengths, replicas)
    else:
        raise ConfigError(f"system.dispatch: unknown {dispatch_rule!r} (one of: {', '.join(DISPATCHES)})")
    if not d.feasible:
        return None, math.inf, 0, "empty_replica"
    lbs = [time_lower_bound(lengths, idx, r) for r, idx in zip(replicas, d.assign)]
    if max(lbs) >= cutoff:
        return None, max(lbs), 0, "pruned"
    plans: list = [None] * len(replicas)
    solves, worst = 0, -math.inf
    # the replica with the highest bound first: it decides whether the candidate can still win
    for k in sorted(range(len(replicas)), key=lambda k: -lbs[k]):
        r, idx = replicas[k], d.assign[k]
        try:
            p: Packing = pack_replica(lengths, idx, r, v_window=v_window, time_limit_s=time_limit_s,
                                      node_limit=node_limit, mip_rel_gap=mip_rel_gap,
                                      target=worst if ilp_scope == "critical" else -math.inf)
        except PackingInfeasible:
            # A replica its dispatch filled beyond what the v window packs (a tight cap, few
            # micro-batches allowed): the candidate has no plan this step, as an empty replica.
            return None, math.inf, solves, "no_pack"
        solves += p.ilp_solves
        worst = max(worst, p.score)
        t = replica_time_ms(lengths, p.micro_batches, r)
        if t >= cutoff:
            return None, t, solves, "pruned"
        plans[k] = ReplicaPlan(r, p.micro_batches, p.score, t, p.status, p.lower_bound)
    return plans, max(p.time_ms for p in plans), solves, "ok"


def plan_step(lengths: Sequence[int], candidates: Sequence[Sequence[ReplicaCost]], *, shuffles: int = 100,
              seed: int = 0, v_window: int = 16, time_limit_s: float = 0.5, node_limit: Optional[int] = None,
              mip_rel_gap: float = 0.0, dispatch_rule: str = "greedy", includes_c: bool = True,
              ilp_scope: str = "critical", refine: bool = True, budget: int = DEFAULT_BUDGET) -> StepPlan:
    """The winning candidate's plan (smallest predicted 1F1B time; ties: the earlier in the pool).
    Candidates are visited in pool order; one that provably cannot beat the best so far is
    pruned (exact: the winner and its packing are unchanged)."""
    t0 = time.perf_counter()
    if ilp_scope not in ILP_SCOPES:
        raise ConfigError(f"system.ilp_scope: unknown {ilp_scope!r} (one of: {', '.join(ILP_SCOPES)})")
    lengths = [int(x) for x in lengths]
    _check_inputs(lengths, candidates)
    best: Optional[tuple[float, int, list]] = None
    scores, outcomes, solves = [], [], 0
    for ci, cand in enumerate(candidates):
        plans, score, s, outcome = plan_candidate(
            lengths, cand, shuffles=shuffles, seed=seed, v_window=v_window, time_limit_s=time_limit_s,
            node_limit=node_limit, mip_rel_gap=mip_rel_gap, dispatch_rule=dispatch_rule, includes_c=includes_c,
            cutoff=best[0] if best else math.inf, ilp_scope=ilp_scope, refine=refine, budget=budget)
        solves += s
        scores.append(score)
        outcomes.append(outcome)
        if plans is not None and (best is None or score < best[0]):
            best = (score, ci, plans)
    if best is None and "no_pack" in outcomes:
        raise ConfigError(f"strategy pool: no candidate of {len(candidates)} has a plan for this batch of "
                          f"{len(lengths)} sequences (outcomes: {', '.join(sorted(set(outcomes)))})")
    if best is None:
        raise ConfigError(f"strategy pool: every one of {len(candidates)} candidates leaves a replica without "
                          f"data for this batch of {len(lengths)} sequences (such a candidate is dropped)")
    _, ci, plans = best
    statuses: dict[str, int] = {}
    for p in plans:
        statuses[p.status] = statuses.get(p.status, 0) + 1
    return StepPlan(candidate=ci, replicas=plans, predicted_ms=max(p.time_ms for p in plans),
                    plan_time_s=time.perf_counter() - t0, score=max(p.score for p in plans), candidate_scores=scores,
                    statuses=statuses, ilp_solves=solves, outcomes=outcomes)


def check_plan(lengths: Sequence[int], plan: StepPlan, num_gpus: Optional[int] = None, mem=None) -> None:
    """The planner-side invariants (README "Invariants and tests"); raises AssertionError naming the first broken one."""
    seen: dict[int, int] = {}
    for r in plan.replicas:
        assert r.micro_batches, f"replica {r.replica.label()} received no sequences"
        for mb in r.micro_batches:
            assert mb, f"replica {r.replica.label()} has an empty micro-batch"
            tok = sum(lengths[i] for i in mb)
            assert tok <= r.replica.cap, f"micro-batch of {tok} tokens > cap {r.replica.cap} on {r.replica.label()}"
            if mem is not None:
                assert mem.fits(r.replica.tp, r.replica.pp, tok), f"M(S) of {tok} tokens exceeds memory on {r.replica.label()}"
            for i in mb:
                assert i not in seen, f"sequence {i} assigned twice"
                seen[i] = 1
    assert len(seen) == len(lengths), f"{len(lengths) - len(seen)} sequences unassigned"
    assert sum(lengths[i] for i in seen) == sum(lengths), "token count differs from the batch"
    if num_gpus is not None:
        used = sum(r.replica.gpus for r in plan.replicas)
        assert used == num_gpus, f"Σ tp·pp = {used} != N = {num_gpus}"
    for r in plan.replicas:
        s = packing_score(lengths, r.micro_batches, r.replica)
        assert math.isclose(s, r.score, rel_tol=1e-9), f"score {r.score} != recomputed {s}"
        t = replica_time_ms(lengths, r.micro_batches, r.replica)
        assert math.isclose(t, r.time_ms, rel_tol=1e-9), f"time {r.time_ms} != recomputed {t}"
    assert math.isclose(plan.predicted_ms, max(r.time_ms for r in plan.replicas), rel_tol=1e-9)
