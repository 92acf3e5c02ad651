"""MILP oracle for ADAPTRA's scheduler gap (scenario S8, impl/adaptra/README.md).

The ZeroBubble ILP (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24) with the per-link
delay ``c_i`` added to every cross-stage dependency. It is used only to measure how far the
list scheduler of Alg. 3/4 (:mod:`impl.common.schedule.list_scheduler`) is from the best schedule; the paper
claims < 1%; that comparison is :mod:`impl.adaptra.milp_gap`. It is solved with
HiGHS (``highspy``), not by us.

Model (times in units of the longest op, so the solver's absolute tolerances are relative):

* one continuous start time per op ``(stage i, kind F/B/W, micro-batch j)`` and the makespan C;
* precedence, with ``c`` only across stages (within a stage it is 0):
  ``F_{i,j} + tF_i + c_i <= F_{i+1,j}``; on the last stage ``F_{S−1,j} + tF <= B_{S−1,j}``;
  ``B_{i+1,j} + tB_{i+1} + c_i <= B_{i,j}``; ``B_{i,j} + tB_i <= W_{i,j}``;
  ``W_{i,j} + tW_i <= C``. (``F_{i,j} <= B_{i,j}`` on earlier stages follows from the chain.)
* activation memory (optional): at most ``M_i`` forwards started whose B has not ended.
* one stage runs one op at a time: for two ops x, y of different kinds on a stage whose
  order is not already implied, a binary ``z = [x before y]`` with big-M constraints
  ``x + d_x <= y + M(1−z)`` and ``y + d_y <= x + M·z``, M taken from the variable windows.
* objective: minimise C (the end of the last W).

Fixed order within a kind, w.l.o.g. (this is what makes S=8, N=32 tractable): on every stage
the F's run in micro-batch order, and so do the B's and the W's. Proof: take any feasible
schedule and, on every (stage, kind), give the k-th op in time the label k. Ops of one
(stage, kind) have the same duration, so their end order equals their start order. Every
dependency has the form ``end(x_j) + lag <= start(y_j)`` between two (stage, kind) groups
with one op per micro-batch each; if some bijection satisfies it, the sorted one does (the
k-th earliest y starts after at least k x's ended + lag, hence after the k-th earliest).
The dependency graph of one micro-batch is a tree (F chain, B chain back, W off each B), so
relabeling every group by rank satisfies all edges at once. No-overlap and the memory count
("F's started minus B's ended") depend only on the slot times, not on labels. Hence the
relabeled schedule is feasible with the same makespan. With the order fixed, memory is linear:
``F_{i,j}`` starts after ``B_{i,j−M_i}`` ends; and F_j before B_k (k >= j), F_j before W_k
(k >= j), B_j before W_k (k >= j), B_k before F_j (k <= j−M_i) need no binary.

Further tightening, all valid: variable windows ``[earliest start, H − tail]`` from longest
paths, where H is the makespan of a feasible heuristic schedule (the optimum is <= H); pairs
whose windows cannot overlap get no binary; the binaries of one kind pair are monotone
(a staircase); C is bounded below by the critical path and by each stage's work plus the
time it must wait before its first B.

``status`` is HiGHS's: ``"optimal"`` means proved within ``mip_rel_gap``; ``"time_limit"``
returns the incumbent and the proved lower bound (``bound_s``), never a claim of optimality.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from impl.common.api import ConfigError
from impl.common.schedule.ir import Action, Op, Schedule
from impl.common.schedule.list_scheduler import check_times

_KINDS = (Op.F, Op.B, Op.W)
_F, _B, _W = 0, 1, 2
_KIND_INDEX = {Op.F: _F, Op.B: _B, Op.W: _W}
# (earlier kind, later kind) pairs that may need an ordering binary on a stage
_PAIRS = ((_F, _B), (_F, _W), (_B, _W))


@dataclass(frozen=True)
class MilpResult:
    makespan_s: float  # makespan of the returned schedule (exact replay of its order)
    bound_s: float  # proved lower bound on the optimum
    gap: float  # (makespan − bound) / makespan, from the two numbers above
    solver_mip_gap: float  # HiGHS's own relative gap (its objective units), for the record
    status: str  # "optimal" (within mip_rel_gap), "time_limit", or HiGHS's status text
    solve_time_s: float  # HiGHS run time (model build and heuristic excluded)
    schedule: Schedule  # compute-only, per-stage op order (F/B/W actions)
    start_s: dict[int, list[float]]  # aligned with schedule[stage], exact replay times
    memory_limit: Optional[tuple[int, ...]]
    heuristic_s: float  # makespan of the best heuristic start (the H of the windows)
    num_binaries: int
    num_rows: int

    @property
    def optimal(self) -> bool:
        return self.status == "optimal"


def _check_inputs(tF, tB, tW, c, num_microbatches, memory_limit):
    S, tF, tB, tW, c = check_times(tF, tB, tW, c)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, (int, np.integer)) \
            or num_microbatches < 1:
        raise ConfigError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    mem = None
    if memory_limit is not None:
        if len(memory_limit) != S:
            raise ConfigError(f"memory_limit has {len(memory_limit)} entries, expected num_stages {S}")
        mem = []
        for i, m in enumerate(memory_limit):
            if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
                raise ConfigError(f"memory_limit[{i}] = {m!r} must be an integer >= 1 (activations)")
            mem.append(int(m))
        mem = tuple(mem)
    return tF, tB, tW, c, int(num_microbatches), mem


# --------------------------------------------------------------------------- exact replay

def replay_order(schedule: Schedule, tF: Sequence[float], tB: Sequence[float], tW: Sequence[float],
                 c: Sequence[float]) -> tuple[dict[int, list[float]], float]:
    """Start times of a compute-only order run as early as possible, and its makespan.

    The oracle's semantics exactly: each stage runs its list in order, an op starts when the
    stage is free and its inputs are there (cross-stage inputs ``c_i`` after the producer
    ends), no other communication cost. Raises ConfigError if the order deadlocks.
    """
    S = len(tF)
    dur = (tF, tB, tW)
    end: dict[tuple[int, int, int], float] = {}  # (kind, stage, mb) -> end time
    starts = {s: [] for s in range(S)}
    ptr, free = [0] * S, [0.0] * S
    progress = True
    while progress:
        progress = False
        for s in range(S):
            acts = schedule[s]
            while ptr[s] < len(acts):
                a = acts[ptr[s]]
                k = _KIND_INDEX.get(a.op)
                if k is None:
                    raise ConfigError(f"stage {s} action {a}: the oracle replays compute-only F/B/W schedules")
                if k == _F:
                    dep = [(_F, s - 1, a.mb, c[s - 1])] if s > 0 else []
                elif k == _B:
                    dep = [(_F, s, a.mb, 0.0)] + ([(_B, s + 1, a.mb, c[s])] if s + 1 < S else [])
                else:
                    dep = [(_B, s, a.mb, 0.0)]
                if any((dk, ds, dm) not in end for dk, ds, dm, _ in dep):
                    break
                t0 = max([free[s]] + [end[(dk, ds, dm)] + lag for dk, ds, dm, lag in dep])
                starts[s].append(t0)
                free[s] = end[(k, s, a.mb)] = t0 + dur[k][s]
                ptr[s] += 1
                progress = True
    stuck = [s for s in range(S) if ptr[s] < len(schedule[s])]
    if stuck:
        s = stuck[0]
        raise ConfigError(f"schedule deadlocks: stage {s} waits forever at {schedule[s][ptr[s]]} "
                          f"(position {ptr[s]})")
    return starts, max(free)


def _slots(schedule: Schedule, starts: dict[int, list[float]], S: int, N: int) -> np.ndarray:
    """Start times relabeled by rank per (stage, kind): slot[i, kind, k] = k-th earliest start.

    By the exchange argument in the module docstring this is a feasible point of the
    fixed-order model with the same makespan.
    """
    slot = np.zeros((S, 3, N))
    for s in range(S):
        for k in range(3):
            ts = sorted(t for a, t in zip(schedule[s], starts[s]) if _KIND_INDEX[a.op] == k)
            if len(ts) != N:
                raise ConfigError(f"stage {s} runs {len(ts)} {_KINDS[k].value} ops, expected {N}")
            slot[s, k] = ts
    return slot


# --------------------------------------------------------------------------- heuristic start

def _heuristic(tF, tB, tW, c, N, mem) -> tuple[Schedule, dict[int, list[float]], float]:
    """Best of a few list-scheduler runs with generic warm-up quotas (not ADAPTRA's Alg. 2).

    Only used for the windows' horizon H and as the solver's first incumbent; any feasible
    schedule is valid here, a better one just makes the model smaller. When ``mem`` is a
    non-increasing quota vector (as in :func:`scheduler_gap`), the first candidate is exactly
    the builder's run at those quotas, so the incumbent starts no worse than the builder; an
    "optimal" status rests on the solver's bound alone, not on where the incumbent came from.
    """
    from impl.common.schedule.list_scheduler import build_schedule
    from impl.common.schedule.validate import peak_inflight

    S = len(tF)
    cap = [N if mem is None else min(N, m) for m in (mem or [N] * S)]
    targets = [[N] * S] + [[k * (S - i) for i in range(S)] for k in (1, 2, 3, 4, 6)]
    best = None
    seen = set()
    for g in targets:
        q, prev = [], N
        for i in range(S):
            prev = max(1, min(g[i], cap[i], prev))  # non-increasing, within memory, >= 1
            q.append(prev)
        if tuple(q) in seen:
            continue
        seen.add(tuple(q))
        sched = build_schedule(tF, tB, tW, c, q, num_microbatches=N, limit_inflight=True)
        if mem is not None and any(peak_inflight(sched)[s] > mem[s] for s in range(S)):
            continue  # cannot happen with limit_inflight, but never seed an infeasible point
        starts, ms = replay_order(sched, tF, tB, tW, c)
        if best is None or ms < best[2] - 1e-12:
            best = (sched, starts, ms)
    return best


# --------------------------------------------------------------------------- model

def _longest_paths(n_nodes: int, edges: list[tuple[int, int, float]], dur: np.ndarray):
    """Earliest starts (from time 0) and tails (longest path from a start to the end,
    own duration included) over the precedence DAG."""
    succ: list[list[tuple[int, float]]] = [[] for _ in range(n_nodes)]
    indeg = [0] * n_nodes
    for u, v, lag in edges:
        succ[u].append((v, lag))
        indeg[v] += 1
    order, queue = [], deque(i for i in range(n_nodes) if indeg[i] == 0)
    while queue:
        u = queue.popleft()
        order.append(u)
        for v, _ in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                queue.append(v)
    if len(order) != n_nodes:  # cannot happen for valid inputs; guards the model's construction
        raise RuntimeError("precedence graph of the MILP has a cycle")
    es = np.zeros(n_nodes)
    for u in order:
        for v, lag in succ[u]:
            es[v] = max(es[v], es[u] + lag)
    tail = dur.copy()
    for u in reversed(order):
        for v, lag in succ[u]:
            tail[u] = max(tail[u], lag + tail[v])
    return es, tail


def solve_pipeline_milp(tF: Sequence[float], tB: Sequence[float], tW: Sequence[float], c: Sequence[float],
                        num_microbatches: int, *, memory_limit: Optional[Sequence[int]] = None,
                        time_limit_s: float = 60.0, mip_rel_gap: float = 1e-4,
                        initial_schedule: Optional[Schedule] = None, threads: int = 1,
                        seed: int = 0) -> MilpResult:
    """Minimum-makespan F/B/W schedule under the ZeroBubble ILP with link delays ``c``.

    ``memory_limit[i]``: most activations stored on stage i (F started, its B not ended);
    None = unlimited. ``initial_schedule`` (compute-only, must respect the memory limit) is an
    optional extra starting incumbent; without it the solver starts from generic list-scheduler
    runs. Runs are deterministic for a fixed ``seed`` and ``threads``.
    """
    import highspy

    tF, tB, tW, c, N, mem = _check_inputs(tF, tB, tW, c, num_microbatches, memory_limit)
    if not time_limit_s > 0:
        raise ConfigError(f"time_limit_s must be > 0, got {time_limit_s}")
    if not 0 <= mip_rel_gap < 1:
        raise ConfigError(f"mip_rel_gap must be in [0, 1), got {mip_rel_gap}")
    S = len(tF)

    # -- incumbent for the horizon H
    h_sched, h_starts, h_ms = _heuristic(tF, tB, tW, c, N, mem)
    if initial_schedule is not None:
        from impl.common.schedule.validate import peak_inflight, validate_schedule

        validate_schedule(initial_schedule, S, N, split_backward=True, memory_limit=mem)
        i_starts, i_ms = replay_order(initial_schedule, tF, tB, tW, c)
        if i_ms < h_ms:
            h_sched, h_starts, h_ms = initial_schedule, i_starts, i_ms
    seed_slots = _slots(h_sched, h_starts, S, N)

    # -- scaled data: unit = longest op, so tolerances (1e-6 absolute) are relative to an op
    unit = max(tF + tB + tW)
    d = np.array([tF, tB, tW]).T / unit  # d[stage, kind]
    cs = np.array(c) / unit
    H = h_ms / unit

    def var(i: int, k: int, j: int) -> int:
        return (i * 3 + k) * N + j

    n_ops = 3 * S * N
    C = n_ops  # makespan column
    dur = np.array([d[i, k] for i in range(S) for k in range(3) for _ in range(N)])

    edges: list[tuple[int, int, float]] = []
    for i in range(S):
        for j in range(N):
            if i + 1 < S:
                edges.append((var(i, _F, j), var(i + 1, _F, j), d[i, _F] + cs[i]))
                edges.append((var(i + 1, _B, j), var(i, _B, j), d[i + 1, _B] + cs[i]))
            else:
                edges.append((var(i, _F, j), var(i, _B, j), d[i, _F]))
            edges.append((var(i, _B, j), var(i, _W, j), d[i, _B]))
            for k in range(3):
                if j + 1 < N:  # fixed order within a kind (w.l.o.g., see module docstring)
                    edges.append((var(i, k, j), var(i, k, j + 1), d[i, k]))
            if mem is not None and j >= mem[i]:
                edges.append((var(i, _B, j - mem[i]), var(i, _F, j), d[i, _B]))
    es, tail = _longest_paths(n_ops, edges, dur)
    lb = es + 0.0  # variable lower bounds
    ub = np.maximum(H - tail, lb)  # latest starts that still allow makespan <= H (max: float fuzz)

    # lower bounds on C: critical path, and per stage "wait for the first B, then all the
    # rest": before B_{i,0} can start only F's can run, at most as many as can start by then
    c_lb = float(np.max(es + tail))
    for i in range(S):
        eb = es[var(i, _B, 0)]
        total = N * d[i].sum()
        before = sum(min(d[i, _F], max(0.0, eb - es[var(i, _F, j)])) for j in range(N))
        before = min(before, eb - es[var(i, _F, 0)])
        c_lb = max(c_lb, es[var(i, _F, 0)] + total, eb + total - before)
    if H < c_lb - 1e-9:  # a feasible schedule below a valid lower bound means a model bug
        raise RuntimeError(f"heuristic makespan {H} below the MILP lower bound {c_lb}")

    rows_i: list[list[int]] = []
    rows_v: list[list[float]] = []
    rows_lo: list[float] = []
    rows_hi: list[float] = []

    def row(idx, val, lo, hi):
        rows_i.append(idx)
        rows_v.append(val)
        rows_lo.append(lo)
        rows_hi.append(hi)

    for u, v, lag in edges:  # s_v − s_u >= lag
        row([v, u], [1.0, -1.0], lag, math.inf)
    for i in range(S):  # C >= end of the last W (the W chain covers the others)
        row([C, var(i, _W, N - 1)], [1.0, -1.0], d[i, _W], math.inf)

    # ordering binaries
    def implied(i: int, kx: int, jx: int, ky: int, jy: int) -> Optional[bool]:
        """True: x before y is implied; False: y before x is; None: needs a binary."""
        if jy >= jx:
            return True  # y_{jy} follows x_{jy} (same micro-batch) which follows x_{jx}
        if kx == _F and ky == _B and mem is not None and jy <= jx - mem[i]:
            return False  # memory edge: F_jx starts after B_{jx−M} ends
        x, y = var(i, kx, jx), var(i, ky, jy)
        if ub[x] + dur[x] <= lb[y] + 1e-9:
            return True
        if ub[y] + dur[y] <= lb[x] + 1e-9:
            return False
        return None

    n_cols = C + 1
    zcol: dict[tuple[int, int, int, int, int], object] = {}
    bin_lb: list[float] = []
    bin_ub: list[float] = []
    for i in range(S):
        for kx, ky in _PAIRS:
            for jx in range(N):
                for jy in range(N):
                    imp = implied(i, kx, jx, ky, jy)
                    if imp is not None:
                        zcol[(i, kx, ky, jx, jy)] = imp
                        continue
                    z = n_cols
                    n_cols += 1
                    bin_lb.append(0.0)
                    bin_ub.append(1.0)
                    zcol[(i, kx, ky, jx, jy)] = z
                    x, y = var(i, kx, jx), var(i, ky, jy)
                    m1 = ub[x] + dur[x] - lb[y]  # x + d_x − y <= m1 (1 − z)
                    m2 = ub[y] + dur[y] - lb[x]  # y + d_y − x <= m2 z
                    row([x, y, z], [1.0, -1.0, m1], -math.inf, m1 - dur[x])
                    row([y, x, z], [1.0, -1.0, -m2], -math.inf, -dur[y])
            # staircase: x_j before y_k  =>  x_j before y_{k+1}, and x_{j−1} before y_k
            for jx in range(N):
                for jy in range(N):
                    a = zcol[(i, kx, ky, jx, jy)]
                    for b in ([zcol[(i, kx, ky, jx, jy + 1)]] if jy + 1 < N else []) + \
                             ([zcol[(i, kx, ky, jx - 1, jy)]] if jx > 0 else []):
                        _monotone(a, b, row, bin_ub, bin_lb, C + 1)
    n_bin = n_cols - (C + 1)

    # -- assemble and solve
    col_lo = np.concatenate([lb, [c_lb], bin_lb]) if n_bin else np.concatenate([lb, [c_lb]])
    col_hi = np.concatenate([ub, [H], bin_ub]) if n_bin else np.concatenate([ub, [H]])
    indptr = np.cumsum([0] + [len(r) for r in rows_i])
    a_idx = np.array([x for r in rows_i for x in r], dtype=np.int32)
    a_val = np.array([x for r in rows_v for x in r], dtype=float)
    lp = highspy.HighsLp()
    lp.num_col_ = n_cols
    lp.num_row_ = len(rows_i)
    cost = np.zeros(n_cols)
    cost[C] = 1.0
    lp.col_cost_ = cost
    lp.col_lower_ = col_lo
    lp.col_upper_ = col_hi
    lp.row_lower_ = np.array(rows_lo)
    lp.row_upper_ = np.array(rows_hi)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = n_cols
    lp.a_matrix_.num_row_ = len(rows_i)
    lp.a_matrix_.start_ = indptr.astype(np.int32)
    lp.a_matrix_.index_ = a_idx
    lp.a_matrix_.value_ = a_val
    lp.integrality_ = [highspy.HighsVarType.kContinuous] * (C + 1) + [highspy.HighsVarType.kInteger] * n_bin

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("random_seed", int(seed))
    h.passModel(lp)

    # the heuristic schedule, relabeled by rank, as the first incumbent
    x0 = np.zeros(n_cols)
    for i in range(S):
        for k in range(3):
            for j in range(N):
                x0[var(i, k, j)] = seed_slots[i, k, j] / unit
    x0[C] = H
    for (i, kx, ky, jx, jy), z in zcol.items():
        if not isinstance(z, bool):
            x0[z] = 1.0 if seed_slots[i, kx, jx] < seed_slots[i, ky, jy] else 0.0
    h.setSolution(n_cols, np.arange(n_cols, dtype=np.int32), x0)

    h.run()
    solve_time = h.getRunTime()
    model_status = h.getModelStatus()
    info = h.getInfo()
    status = {highspy.HighsModelStatus.kOptimal: "optimal",
              highspy.HighsModelStatus.kTimeLimit: "time_limit",
              highspy.HighsModelStatus.kInfeasible: "infeasible"}.get(
        model_status, h.modelStatusToString(model_status).lower().replace(" ", "_"))

    sched, starts, ms = h_sched, h_starts, h_ms
    if int(info.primal_solution_status) == 2:  # kSolutionStatusFeasible: HiGHS holds an incumbent
        x = np.asarray(h.getSolution().col_value)
        cand = {}
        for i in range(S):
            ops = [(x[var(i, k, j)], k, j) for k in range(3) for j in range(N)]
            ops.sort()
            cand[i] = [Action(_KINDS[k], j) for _, k, j in ops]
        # the order is what the oracle returns; its exact times come from replaying it, which
        # can only be earlier than the solver's (tolerance-fuzzy) values
        c_starts, c_ms = replay_order(cand, tF, tB, tW, c)
        if c_ms < ms:
            sched, starts, ms = cand, c_starts, c_ms
    bound = unit * info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else unit * c_lb
    bound = min(max(bound, unit * c_lb), ms)  # HiGHS's bound includes C's lower bound anyway
    gap = (ms - bound) / ms if ms > 0 else 0.0
    return MilpResult(makespan_s=ms, bound_s=bound, gap=gap, solver_mip_gap=float(info.mip_gap),
                      status=status, solve_time_s=float(solve_time), schedule=sched, start_s=starts,
                      memory_limit=mem, heuristic_s=h_ms, num_binaries=n_bin, num_rows=len(rows_i))


def _monotone(a, b, row, bin_ub, bin_lb, first_bin: int) -> None:
    """Add z_a <= z_b, where each side is a binary column or a constant (True/False)."""
    if isinstance(a, bool) and isinstance(b, bool):
        return  # both implied by precedence, hence consistent
    if isinstance(b, bool):
        if not b:
            bin_ub[a - first_bin] = 0.0  # z_b = 0 forces z_a = 0
        return
    if isinstance(a, bool):
        if a:
            bin_lb[b - first_bin] = 1.0  # z_a = 1 forces z_b = 1
        return
    row([a, b], [1.0, -1.0], -math.inf, 0.0)
