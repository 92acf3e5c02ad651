"""Scheme pool and the static deployment planners (the artifact's rules, github.com/ccchengff/LobRA
`scripts/pruning_static_planner.sh`), data in, data out.

- :func:`scheme_pool`: per max_tokens, the best per-GPU-throughput scheme and the fewest-GPU
  scheme (the artifact's rule).
- :func:`multisets`: every multiset of pool schemes whose GPUs sum to N (unbounded knapsack).
- :func:`plan` with ``planner``:
  - ``prune`` (default): multisets whose largest max_tokens is 2^⌈log2 max length⌉; a lower
    bound per multiset; keep those within ``keep_within`` (15%) of the best multiset without
    repeated max_tokens, at least ``keep_min`` (8); the balanced ILP on the expected batch picks
    the winner. The bound is the LP relaxation of balanced dispatch with every micro-batch full
    (a true lower bound of the ILP's makespan); the artifact's GPU-weighted average of
    length-based times is computed too and ``info.pruning_disagreements`` lists the candidates
    the two rules keep differently.
  - ``group``: every eligible multiset under length-based dispatch (exact), the minimum.
  - ``balance``: every eligible multiset under the balanced ILP (the joint optimum over dp_j
    and n_ij, by enumeration), the minimum.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from impl.common.api import ConfigError

from impl.lobra.cost.replica import Scheme, pow2_ceil
from impl.lobra.dispatch import ReplicaGroup, balanced, length_based

class DeploymentPlanner(enum.StrEnum):
    """The deployment planner: pruned scheme pool (LobRA), task grouping, or load balance only."""

    prune = "prune"
    group = "group"
    balance = "balance"


PLANNERS = tuple(DeploymentPlanner)


def scheme_pool(schemes: Sequence[Scheme]) -> list[Scheme]:
    by: dict[int, list[Scheme]] = {}
    for s in schemes:
        by.setdefault(s.max_tokens, []).append(s)
    out = []
    for m in sorted(by):
        best = max(by[m], key=lambda s: (s.throughput_per_gpu(), -s.gpus))
        few = min(by[m], key=lambda s: (s.gpus, -s.throughput_per_gpu()))
        out += [best] if best is few else [best, few]
    return out


def multisets(pool: Sequence[Scheme], n: int, limit: int = 200000) -> list[tuple[int, ...]]:
    """Counts per pool scheme with Σ count·gpus = n."""
    out: list[tuple[int, ...]] = []
    counts = [0] * len(pool)

    def rec(k: int, left: int) -> None:
        if len(out) > limit:
            raise ConfigError(f"planner: more than {limit} scheme combinations for {n} GPUs; shrink the pool")
        if left == 0:
            out.append(tuple(counts))
            return
        if k == len(pool):
            return
        g = pool[k].gpus
        for c in range(left // g, -1, -1):
            counts[k] = c
            rec(k + 1, left - c * g)
        counts[k] = 0

    rec(0, n)
    return out


def groups_of(pool: Sequence[Scheme], counts: Sequence[int]) -> list[ReplicaGroup]:
    return [ReplicaGroup(s, c) for s, c in zip(pool, counts) if c]


@dataclass
class DeploymentPlan:
    groups: list[ReplicaGroup]
    expected_step_s: float
    planner: str
    planner_s: float
    candidates: int
    kept: int
    info: dict = field(default_factory=dict)

    def describe(self) -> list[str]:
        return [f"{g.dp}x{g.scheme.label}" for g in self.groups]


def lp_bound(groups: Sequence[ReplicaGroup], buckets: Sequence[int], counts: Sequence[int]) -> float:
    """min z s.t. Σ_j x_ij = N_i, z ≥ Σ_i x_ij·t_j(mbs_ij, s_i)/(mbs_ij·dp_j), x ≥ 0 (full micro-batches)."""
    from scipy.optimize import linprog

    I, J = len(buckets), len(groups)
    nv = 1 + I * J
    c = np.zeros(nv)
    c[0] = 1.0
    A_ub, b_ub, A_eq, b_eq = [], [], [], []
    bounds = [(0, None)] * nv
    for i in range(I):
        row = np.zeros(nv)
        for j in range(J):
            row[1 + i * J + j] = 1
            if groups[j].scheme.mbs(buckets[i]) < 1:
                bounds[1 + i * J + j] = (0, 0)
        A_eq.append(row)
        b_eq.append(counts[i])
    for j, g in enumerate(groups):
        row = np.zeros(nv)
        row[0] = -1
        for i, s in enumerate(buckets):
            mbs = g.scheme.mbs(s)
            if mbs >= 1:
                row[1 + i * J + j] = g.scheme.t(mbs, s) / (mbs * g.dp)
        A_ub.append(row)
        b_ub.append(0.0)
    res = linprog(c, A_ub=np.array(A_ub), b_ub=b_ub, A_eq=np.array(A_eq), b_eq=b_eq, bounds=bounds, method="highs")
    return float(res.fun) if res.status == 0 else float("inf")


def weighted_estimate(groups: Sequence[ReplicaGroup], buckets, counts) -> float:
    """The artifact's estimate: GPU-weighted average of length-based replica times."""
    d = length_based(groups, buckets, counts)
    n = sum(g.gpus for g in groups)
    return sum(g.gpus * t for g, t in zip(groups, d.group_time_s)) / n


def plan(schemes: Sequence[Scheme], num_gpus: int, buckets: Sequence[int], counts: Sequence[int], max_len: int, *,
         planner: str = "prune", keep_within: float = 0.15, keep_min: int = 8, keep_max: int = 12, time_limit_s: float = 5.0,
         mip_gap: float = 0.005, use_pool: bool = True) -> DeploymentPlan:
    if planner not in PLANNERS:
        raise ConfigError(f"system.planner: unknown {planner!r} (one of: {', '.join(PLANNERS)})")
    t0 = time.perf_counter()
    pool = scheme_pool(schemes) if use_pool else list(schemes)
    need = pow2_ceil(max_len)
    top = max((s.max_tokens for s in pool), default=0)
    if top < max_len:
        raise ConfigError(f"workload.tasks: the longest sequence {max_len} is beyond every replica's max_tokens "
                          f"(largest {top})")
    sets = multisets(pool, num_gpus)
    if not sets:
        raise ConfigError(f"workload.num_gpus: {num_gpus} GPUs: no combination of schemes sums to it "
                          f"(pool GPU counts {sorted({s.gpus for s in pool})})")
    want = min(need, top) if top >= need else top
    eligible = [c for c in sets if max(s.max_tokens for s, k in zip(pool, c) if k) == want]
    if not eligible:
        raise ConfigError(f"workload.num_gpus: {num_gpus} GPUs: no scheme combination includes a replica with "
                          f"max_tokens {want} (pool {[s.label for s in pool]})")
    info: dict = {"pool": [s.label for s in pool], "eligible": len(eligible)}
    if planner == "group":
        scored = [(length_based(groups_of(pool, c), buckets, counts).objective_s, c) for c in eligible]
        best_t, best = min(scored)
        return DeploymentPlan(groups_of(pool, best), best_t, planner, time.perf_counter() - t0, len(eligible), len(eligible), info)
    if planner == "balance":
        kept = eligible
    else:
        bounds = {c: lp_bound(groups_of(pool, c), buckets, counts) for c in eligible}
        est = {c: weighted_estimate(groups_of(pool, c), buckets, counts) for c in eligible}
        distinct = [c for c in eligible if len({pool[k].max_tokens for k, n in enumerate(c) if n})
                    == sum(1 for n in c if n)]
        ref = min(bounds[c] for c in (distinct or eligible))
        order = sorted(eligible, key=lambda c: bounds[c])
        kept = [c for c in order if bounds[c] <= ref * (1 + keep_within)]
        if len(kept) < keep_min:
            kept = order[:keep_min]
        info["within_bound"] = len(kept)
        kept = kept[:max(keep_min, keep_max)]
        ref_e = min(est[c] for c in (distinct or eligible))
        order_e = sorted(eligible, key=lambda c: est[c])
        kept_e = [c for c in order_e if est[c] <= ref_e * (1 + keep_within)] or order_e[:keep_min]
        if len(kept_e) < keep_min:
            kept_e = order_e[:keep_min]
        diff = set(kept) ^ set(kept_e)
        info["pruning_disagreements"] = [" + ".join(f"{n}x{pool[k].label}" for k, n in enumerate(c) if n)
                                         for c in sorted(diff)][:20]
    results = []
    for c in kept:
        d = balanced(groups_of(pool, c), buckets, counts, time_limit_s=time_limit_s, mip_gap=mip_gap)
        results.append((d.objective_s, sum(1 for n in c if n), c, d.status))
    best_t, _, best, status = min(results)
    info["solver_status"] = status
    return DeploymentPlan(groups_of(pool, best), best_t, planner, time.perf_counter() - t0, len(eligible), len(kept), info)
