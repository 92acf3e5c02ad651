"""The two integer programs of a heterogeneous DP x PP planner (ILP-A and ILP-B of
Malleus's planner, the authors' code Hetu `python/hetu/engine/strategy.py`, which Elastor's
reference code reuses), solved by existing solvers.

ILP-A (one pipeline, its stages' group rates y_j and memory ratios r_j):
    min z  s.t.  (k_{S-j} l_j + E [j first or last]) r_j + X <= C,  z >= y_j l_j,  sum_j l_j = L,
    l_j >= 0 integer.
ILP-B (all pipelines, their z_i from ILP-A):
    min Z  s.t.  Z >= z_i m_i,  sum_i m_i = M,  m_i >= S_i integer.

``solver='cbc'`` runs PuLP's bundled CBC with the rows written in the reference code's order
(memory, then z, then the layer sum); CBC is deterministic for a given input, and that order
is what reproduces the worked examples of the authors' planner tests (Hetu
`examples/malleus/test_strategy_model.py`) among tied optima (impl/malleus/README.md).
``solver='highs'`` uses scipy.optimize.milp (HiGHS, in-process, faster). Both return exact integer solutions;
the objective is recomputed from the integers, never read back from the solver.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import numpy as np

SOLVERS = ("cbc", "highs")
# ILP-B also accepts 'search': an exact combinatorial solver (binary search over the candidate
# values z_i * m of Z), for planning at >= 512 GPUs where thousands of templates need ILP-B.
SOLVERS_B = ("cbc", "highs", "search")


def _z_of(y: Sequence[float], layers: Sequence[int]) -> float:
    return max(yy * n for yy, n in zip(y, layers))


def _layer_caps(y: Sequence[float], ratios: Sequence[float], num_layers: int, memory) -> list[int]:
    S = len(y)
    return [num_layers if memory is None else min(num_layers, memory.max_layers(S, j, ratios[j])) for j in range(S)]


def ilp_a_value(y: Sequence[float], ratios: Sequence[float], num_layers: int, memory=None) -> Optional[float]:
    """ILP-A's optimal z alone, without a solver; None when memory makes it infeasible.

    The optimum's value is unique where its layers are not (tied optima), so a planner can rank
    templates by it and ask the solver only for the layers of the few it keeps. z is the least
    product y_j * n at which every stage taking the layers with y_j * n <= z holds all of them:
    the same float products :func:`ilp_a` recomputes from a solver's integers."""
    caps = _layer_caps(y, ratios, num_layers, memory)
    if sum(caps) < num_layers:
        return None
    if num_layers == 0:
        return 0.0

    def fits(z: float) -> bool:
        total = 0
        for yy, c in zip(y, caps):
            n = min(c, int(z / yy))
            while n < c and yy * (n + 1) <= z:  # the division may round either way
                n += 1
            while n > 0 and yy * n > z:
                n -= 1
            total += n
        return total >= num_layers

    cands = sorted({yy * n for yy, c in zip(y, caps) for n in range(1, c + 1)})
    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(cands[mid]):
            hi = mid
        else:
            lo = mid + 1
    return cands[lo]


# Both programs are pure functions of their inputs and the solvers deterministic, so a
# process keeps their answers: a Malleus run re-plans with mostly the same pipelines (S7: 13
# plans), and every CBC answer is a subprocess. clear_caches() empties them (benchmarks).
_CACHE_SIZE = 8192


def clear_caches() -> None:
    _ilp_a.cache_clear()
    _ilp_b.cache_clear()


def ilp_a(y: Sequence[float], ratios: Sequence[float], num_layers: int, memory=None,
          solver: str = "cbc") -> Optional[tuple[float, tuple[int, ...]]]:
    """Layers per stage minimising the pipeline's bottleneck z; None when memory makes it infeasible."""
    return _ilp_a(tuple(y), tuple(ratios), num_layers, memory, solver)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _ilp_a(y: tuple, ratios: tuple, num_layers: int, memory, solver: str):
    S = len(y)
    caps = _layer_caps(y, ratios, num_layers, memory)
    if sum(caps) < num_layers:
        return None  # cheap infeasibility test (the memory rows are exactly these caps)
    if solver == "cbc":
        import pulp

        prob = pulp.LpProblem("a", pulp.LpMinimize)
        z = pulp.LpVariable("z", lowBound=0)
        ls = [pulp.LpVariable(f"l_{j}", lowBound=0, cat="Integer") for j in range(S)]
        prob += z
        if memory is not None:
            for j in range(S):
                coef, const, cap = memory.row(S, j, ratios[j])
                prob += coef * ls[j] + const <= cap
        for j in range(S):
            prob += z >= y[j] * ls[j]
        prob += pulp.lpSum(ls) == num_layers
        status = prob.solve(pulp.PULP_CBC_CMD(msg=0))
        if pulp.LpStatus[status] != "Optimal":
            return None
        layers = tuple(int(round(v.value())) for v in ls)
    elif solver == "highs":
        from scipy.optimize import Bounds, LinearConstraint, milp

        # variables: l_0..l_{S-1}, z
        c = np.zeros(S + 1)
        c[S] = 1.0
        rows, lo, hi = [], [], []
        for j in range(S):
            row = np.zeros(S + 1)
            row[j], row[S] = y[j], -1.0
            rows.append(row), lo.append(-np.inf), hi.append(0.0)
        row = np.zeros(S + 1)
        row[:S] = 1.0
        rows.append(row), lo.append(num_layers), hi.append(num_layers)
        res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi),
                   integrality=np.array([1] * S + [0]), bounds=Bounds([0] * (S + 1), caps + [np.inf]))
        if res.status != 0:
            return None
        layers = tuple(int(round(v)) for v in res.x[:S])
    else:
        raise ValueError(f"solver {solver!r} (one of {SOLVERS})")
    if sum(layers) != num_layers or any(n > c for n, c in zip(layers, caps)):
        return None
    return _z_of(y, layers), layers


def ilp_b(z: Sequence[float], stages: Sequence[int], num_microbatches: int,
          solver: str = "highs") -> Optional[tuple[float, tuple[int, ...]]]:
    """Micro-batches per pipeline minimising Z = max_i z_i m_i; None if sum S_i > M."""
    return _ilp_b(tuple(z), tuple(stages), num_microbatches, solver)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _ilp_b(z: tuple, stages: tuple, num_microbatches: int, solver: str):
    D = len(z)
    if sum(stages) > num_microbatches:
        return None
    if solver == "search":
        return _ilp_b_search(z, stages, num_microbatches)
    if solver == "cbc":
        import pulp

        prob = pulp.LpProblem("b", pulp.LpMinimize)
        Z = pulp.LpVariable("Z", lowBound=0)
        ms = [pulp.LpVariable(f"m_{i}", lowBound=stages[i], cat="Integer") for i in range(D)]
        prob += Z
        for i in range(D):
            prob += Z >= z[i] * ms[i]
        prob += pulp.lpSum(ms) == num_microbatches
        status = prob.solve(pulp.PULP_CBC_CMD(msg=0))
        if pulp.LpStatus[status] != "Optimal":
            return None
        m = tuple(int(round(v.value())) for v in ms)
    elif solver == "highs":
        from scipy.optimize import Bounds, LinearConstraint, milp

        c = np.zeros(D + 1)
        c[D] = 1.0
        A = np.zeros((D + 1, D + 1))
        for i in range(D):
            A[i, i], A[i, D] = z[i], -1.0
        A[D, :D] = 1.0
        lo = [-np.inf] * D + [num_microbatches]
        hi = [0.0] * D + [num_microbatches]
        res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=np.array([1] * D + [0]),
                   bounds=Bounds(list(stages) + [0.0], [num_microbatches] * D + [np.inf]))
        if res.status != 0:
            return None
        m = tuple(int(round(v)) for v in res.x[:D])
    else:
        raise ValueError(f"solver {solver!r} (one of {SOLVERS_B})")
    if sum(m) != num_microbatches or any(mi < si for mi, si in zip(m, stages)):
        return None
    return max(zi * mi for zi, mi in zip(z, m)), m


def ilp_b_exact(z: Sequence[float], stages: Sequence[int], num_microbatches: int) -> Optional[float]:
    """The optimum of ILP-B by direct search (used by tests to check the solver)."""
    cands = sorted({zi * mi for zi in z for mi in range(1, num_microbatches + 1)})
    for Z in cands:
        cap = [math.floor(Z / zi + 1e-12) if zi > 0 else num_microbatches for zi in z]
        if all(c >= s for c, s in zip(cap, stages)) and sum(cap) >= num_microbatches:
            return Z
    return None


def _ilp_b_search(z, stages, M):
    def cap(Z):
        return [min(M, math.floor(Z / zi * (1 + 1e-12))) for zi in z]

    def ok(Z):
        c = cap(Z)
        return all(ci >= si for ci, si in zip(c, stages)) and sum(c) >= M

    # every z_i * m, sorted and unique (numpy's float64 products are Python's, bit for bit)
    cands = np.unique(np.multiply.outer(np.asarray(z, dtype=np.float64), np.arange(1, M + 1, dtype=np.float64))).tolist()
    lo, hi = 0, len(cands) - 1
    if not ok(cands[hi]):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(cands[mid]):
            hi = mid
        else:
            lo = mid + 1
    Z = cands[lo]
    m = cap(Z)
    surplus = sum(m) - M
    for i in sorted(range(len(z)), key=lambda i: (-z[i], i)):  # trim the slowest pipelines first
        take = min(surplus, m[i] - stages[i])
        m[i] -= take
        surplus -= take
    return max(zi * mi for zi, mi in zip(z, m)), tuple(m)
