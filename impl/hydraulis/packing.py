"""Stage 2 of Hydraulis' per-step data assignment: balanced packing of one replica's sequences
into micro-batches, as the authors' planner packs (Hetu ``examples/hydraulis/strategy/new_dynamic.py``).

For v in ``[v_min, min(v_max, v_min + v_window − 1)]`` (``v_min = ⌈ΣU/cap⌉``,
``v_max = max(v_min, min(|U|, ⌊ΣU/util⌋))``) the ILP

    o_ij ∈ {0,1};  Σ_j o_ij = 1;  Σ_i o_ij·s_i ≤ cap;  z ≥ Σ_i o_ij·cost(s_i);  minimise z

is solved by HiGHS (``scipy.optimize.milp``) under a time limit and, optionally, a node limit;
a feasible incumbent at a limit is accepted (as theirs). The planning score of a packing is
``(z + c)·(pp − 1 + v)``; the best v wins.

Exactness-preserving shortcuts [R] (they never change the optimum, only skip work):
- a lower bound on z for each v, ``max(max_i cost_i, Σ_i cost_i / v)``, prunes a v whose bound
  score cannot beat the best packing found so far;
- an LPT heuristic (costliest first, into the least-loaded micro-batch with room) runs first;
  when it meets the bound it is optimal and the ILP is skipped (status ``optimal_bound``);
- symmetry breaking: with sequences in cost order, sequence i may only open micro-batch j <= i.
``status`` is the worst over the window (``optimal`` < ``optimal_bound`` < ``below_max`` <
``limit`` < ``heuristic``: ``optimal`` = HiGHS within ``mip_rel_gap``, ``optimal_bound`` = LPT
meets the bound within ``mip_rel_gap``, ``below_max`` = see ``target``, ``limit`` = an incumbent
at the time/node limit, ``heuristic`` = the ILP found nothing better than LPT); ``lower_bound`` is a valid lower bound on the
best score over the window (HiGHS' dual bound where the ILP ran).
A micro-batch that ends up empty is not counted: ``v`` and ``score`` are those of the non-empty
micro-batches, recomputed from the assignment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp  # imported here: not inside a timed plan
from scipy.sparse import lil_matrix

from impl.common.api import ConfigError

from impl.hydraulis.cost.strategy import ReplicaCost

STATUSES = ("optimal", "optimal_bound", "below_max", "limit", "heuristic")


@dataclass(frozen=True)
class Packing:
    micro_batches: list  # list[list[int]]: sequence indices (into lengths), largest micro-batch first
    v: int
    z: float  # ms: max over micro-batches of Σ seq_cost
    score: float  # ms: (z + c)·(pp − 1 + v)
    status: str
    lower_bound: float  # ms: no packing of these sequences (v in the window) scores below it
    ilp_solves: int = 0


class PackingInfeasible(ConfigError):
    """No micro-batch count in the window packs a replica's sequences under its cap: the ILP proved
    it, or stopped at its limit without a packing. The planner drops that candidate for the step."""


def v_range(total: int, n: int, replica: ReplicaCost, v_window: int) -> tuple[int, int]:
    v_min = max(1, math.ceil(total / replica.cap))
    v_max = max(v_min, min(n, total // max(1, replica.util)))
    return v_min, min(v_max, v_min + v_window - 1)


def _lpt(costs: np.ndarray, toks: np.ndarray, v: int, cap: int) -> Optional[list[int]]:
    """Bin of each item (items in the given order), or None if capacity blocks it."""
    load = [0.0] * v
    room = [cap] * v
    out = []
    for c, t in zip(costs.tolist(), toks.tolist()):
        best = -1
        for j in range(v):
            if room[j] >= t and (best < 0 or load[j] < load[best]):
                best = j
        if best < 0:
            return None
        load[best] += c
        room[best] -= t
        out.append(best)
    return out


def _ilp(costs: np.ndarray, toks: np.ndarray, v: int, cap: int, time_limit_s: float,
         node_limit: Optional[int], z_upper: float, mip_rel_gap: float) -> tuple[Optional[list[int]], float, str]:
    """(bins or None, dual bound on z, 'optimal' | 'limit' | 'infeasible')."""
    n = len(costs)
    # variables: o_ij for j <= i (symmetry breaking), then z
    pairs = [(i, j) for i in range(n) for j in range(min(i + 1, v))]
    nv = len(pairs) + 1
    A = lil_matrix((n + 2 * v, nv))
    lo, hi = [], []
    for k, (i, j) in enumerate(pairs):
        A[i, k] = 1.0
        A[n + j, k] = float(toks[i])
        A[n + v + j, k] = float(costs[i])
    for j in range(v):
        A[n + v + j, nv - 1] = -1.0
    lo = [1.0] * n + [-np.inf] * (2 * v)
    hi = [1.0] * n + [float(cap)] * v + [0.0] * v
    obj = np.zeros(nv)
    obj[-1] = 1.0
    integrality = np.ones(nv)
    integrality[-1] = 0
    ub = np.ones(nv)
    ub[-1] = z_upper if math.isfinite(z_upper) else np.inf
    opts = {"time_limit": float(time_limit_s), "disp": False, "mip_rel_gap": float(mip_rel_gap)}
    if node_limit:
        opts["node_limit"] = int(node_limit)
    res = milp(obj, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), ub), options=opts)
    bound = float(getattr(res, "mip_dual_bound", 0.0) or 0.0)
    if res.x is None:
        return None, bound, "infeasible" if res.status == 2 else "limit"
    x = res.x
    bins = [0] * n
    for k, (i, j) in enumerate(pairs):
        if x[k] > 0.5:
            bins[i] = j
    return bins, bound if res.status != 0 else float(res.fun), "optimal" if res.status == 0 else "limit"


def pack_replica(lengths: Sequence[int], idx: Sequence[int], replica: ReplicaCost, v_window: int = 16,
                 time_limit_s: float = 0.5, node_limit: Optional[int] = None, mip_rel_gap: float = 0.0,
                 target: float = -math.inf) -> Packing:
    """Balanced packing of sequences ``idx`` (indices into ``lengths``) on ``replica``.

    ``target``: a score this replica need not beat (another replica of the candidate is
    already slower). An LPT packing scoring <= target is kept without an ILP (status
    ``below_max``): improving it cannot change the candidate's max score."""
    if not 0 <= mip_rel_gap < 1:
        raise ConfigError(f"system.mip_rel_gap: must be in [0, 1), got {mip_rel_gap}")
    if v_window < 1:
        raise ConfigError(f"system.v_window: must be >= 1, got {v_window}")
    if time_limit_s <= 0:
        raise ConfigError(f"system.ilp_time_limit_s: must be > 0, got {time_limit_s}")
    idx = [int(i) for i in idx]
    if not idx:
        raise ConfigError(f"packing: replica {replica.label()} received no sequences")
    toks_all = np.array([int(lengths[i]) for i in idx], dtype=np.int64)
    if toks_all.max() > replica.cap:
        raise ConfigError(f"packing: a sequence of {int(toks_all.max())} tokens exceeds replica "
                          f"{replica.label()} capacity {replica.cap}")
    costs_all = replica.a * toks_all.astype(float) ** 2 + replica.b * toks_all
    order = sorted(range(len(idx)), key=lambda k: (-costs_all[k], idx[k]))
    costs, toks = costs_all[order], toks_all[order]
    ids = [idx[k] for k in order]
    total, n = int(toks.sum()), len(ids)
    v_lo, v_hi = v_range(total, n, replica, v_window)
    pp1, c = replica.pp - 1, replica.c
    best: Optional[tuple[float, list[int], int]] = None  # (score, bins, v)
    worst_status, solves, lb_score = 0, 0, math.inf
    mx, tot = float(costs[0]), float(costs.sum())
    # v in order of its bound (exact: every v is still tried or pruned by its bound), so the
    # first packings found are good and prune the rest
    window = sorted(range(v_lo, v_hi + 1), key=lambda v: ((max(mx, tot / v) + c) * (pp1 + v), v))
    for v in window:
        z_lb = max(mx, tot / v)
        lb = (z_lb + c) * (pp1 + v)
        if best is not None and lb >= best[0]:
            lb_score = min(lb_score, lb)
            continue
        bins = _lpt(costs, toks, v, replica.cap)
        status = "optimal_bound"
        z = math.inf
        if bins is not None:
            z = _z(costs, bins, v)
            if _score(costs, bins, replica) <= target:
                best = (_score(costs, bins, replica), bins, v)
                lb_score = min(lb_score, lb)
                worst_status = max(worst_status, STATUSES.index("below_max"))
                break
        if bins is None or z > z_lb * (1 + max(mip_rel_gap, 1e-12)):
            z_up = z if bins is not None else math.inf
            ibins, dual, st = _ilp(costs, toks, v, replica.cap, time_limit_s, node_limit, z_up, mip_rel_gap)
            solves += 1
            z_lb = max(z_lb, dual)
            lb = (z_lb + c) * (pp1 + v)
            if st == "infeasible" and bins is None:
                continue
            if ibins is not None and _z(costs, ibins, v) <= z:
                bins, z = ibins, _z(costs, ibins, v)
            status = "optimal" if st == "optimal" else ("limit" if st == "limit" else "heuristic")
            if bins is None:
                continue
        lb_score = min(lb_score, lb)
        worst_status = max(worst_status, STATUSES.index(status))
        score = _score(costs, bins, replica)
        if best is None or score < best[0]:
            best = (score, bins, v)
    if best is None:
        raise PackingInfeasible(f"packing: no v in [{v_lo}, {v_hi}] packs {n} sequences ({total} tokens) into "
                          f"micro-batches of {replica.cap} tokens on replica {replica.label()}")
    score, bins, _ = best
    mbs: dict[int, list[int]] = {}
    for k, j in enumerate(bins):
        mbs.setdefault(j, []).append(ids[k])
    cost_of = {i: float(cv) for i, cv in zip(ids, costs)}
    groups = sorted((sorted(g) for g in mbs.values()), key=lambda g: (-sum(cost_of[i] for i in g), g[0]))
    z = max(sum(cost_of[i] for i in g) for g in groups)
    return Packing(groups, len(groups), z, score, STATUSES[worst_status], min(lb_score, score), solves)


def time_lower_bound(lengths: Sequence[int], idx: Sequence[int], replica: ReplicaCost) -> float:
    """A lower bound on the 1F1B time (ms) of any packing of ``idx`` under the replica's cap:
    every sequence's cost once, ``c`` per micro-batch (at least ceil(tokens / cap) of them) and
    ``pp - 1`` times the largest micro-batch, which holds at least the longest sequence."""
    toks = np.array([int(lengths[i]) for i in idx], dtype=float)
    costs = replica.a * toks ** 2 + replica.b * toks
    v_lo = max(1, math.ceil(float(toks.sum()) / replica.cap))
    return float(costs.sum()) + v_lo * replica.c + (replica.pp - 1) * (float(costs.max()) + replica.c)


def _z(costs: np.ndarray, bins: Sequence[int], v: int) -> float:
    load = [0.0] * v
    for cv, j in zip(costs.tolist(), bins):
        load[j] += cv
    return max(load)


def _score(costs: np.ndarray, bins: Sequence[int], replica: ReplicaCost) -> float:
    load: dict[int, float] = {}
    for cv, j in zip(costs.tolist(), bins):
        load[j] = load.get(j, 0.0) + cv
    return (max(load.values()) + replica.c) * (replica.pp - 1 + len(load))


def packing_score(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], replica: ReplicaCost) -> float:
    """The planning score recomputed from an assignment (ms)."""
    z = max(sum(replica.seq_cost(lengths[i]) for i in mb) for mb in micro_batches)
    return (z + replica.c) * (replica.pp - 1 + len(micro_batches))
