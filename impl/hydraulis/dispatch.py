"""Stage 1 of Hydraulis' per-step data assignment: dispatch sequences across replicas by a
randomized greedy min-max (spec hydraulis 2.4, 8, 9).

- Replicas are visited in capacity order (largest first, stable). A sequence that fits only
  one replica goes to it up front; the rest are shuffled (``shuffles`` seeded orders, seeds
  ``(seed, 0..shuffles-1)``) and each is placed on the replica that minimises
  ``max(global_max, acc_r + cost_r(x) + max(warm_r, cost_r(x)·(pp_r − 1)))``.
- Ties (spec 9): the first tied replica, unless a tied replica is still empty: then the last
  such one. The best shuffle (smallest makespan) is kept; if a shuffle leaves a replica empty
  the candidate is infeasible at once (spec 8: the authors' rule; never a silent idle replica).
- ``includes_c`` (pitfall 8: packing prices the constant c per micro-batch, the authors'
  dispatch ignores it). False = the authors' code: ``cost_r(x) = a x² + b x``. True (default,
  consistent with packing): a sequence also carries its share of its micro-batches' constant,
  ``c_r · x / cap_r`` (micro-batches filled to capacity, the v_min packing), and the warm-up
  term prices a full micro-batch ``(cost_r(x) + c_r)·(pp_r − 1)``.
- ``refine`` (spec 10, default True; False = the authors' dispatch alone): after the shuffles,
  one more deterministic order (longest first, the forced sequences still first) is run
  through the same greedy, and the best of all orders goes through a local improvement pass
  (:func:`improve`): moves and swaps of sequences off the critical replica, each accepted only
  when it lowers that replica's time and keeps the other under it. The objective is the same
  greedy estimate ``max_r (acc_r + warm_r)``, so the result is never worse than the best
  shuffle on the same batch. The authors' infeasibility rule is kept: if a shuffle leaves a
  replica empty the candidate is infeasible; a longest-first order that leaves one empty is
  only skipped, and no move ever empties a replica.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from impl.common.api import ConfigError

from .cost import ReplicaCost


@dataclass(frozen=True)
class Dispatch:
    assign: list  # list[list[int]]: sequence indices per replica, in the caller's replica order
    makespan: float  # ms, the greedy's estimate max_r (acc_r + warm_r)
    feasible: bool
    shuffle: int = -1  # index of the winning shuffle (-1: none; LONGEST_FIRST: the longest-first order)
    greedy_makespan: float = math.inf  # the best order's makespan before the improvement pass
    moves: int = 0  # improvement steps accepted (moves + swaps)


LONGEST_FIRST = -2  # Dispatch.shuffle of the deterministic longest-first order


def _check(lengths: Sequence[int], replicas: Sequence[ReplicaCost], shuffles: int) -> None:
    if not replicas:
        raise ConfigError("dispatch: the candidate has no replicas")
    if shuffles < 1:
        raise ConfigError(f"system.shuffles: must be >= 1, got {shuffles}")
    if len(lengths) and min(lengths) < 1:
        raise ConfigError(f"dispatch: sequence lengths must be >= 1, got {min(lengths)}")


def _times(cost: np.ndarray, warm: np.ndarray, rep: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
    """(acc, warm) per replica of assignment ``rep`` (sequence -> replica in capacity order)."""
    idx = np.arange(len(rep))
    acc = np.zeros(R)
    np.add.at(acc, rep, cost[idx, rep])
    w = np.zeros(R)
    np.maximum.at(w, rep, warm[idx, rep])
    return acc, w


def improve(cost: np.ndarray, warm: np.ndarray, rep: np.ndarray, max_steps: int = 100000) -> tuple[np.ndarray, int]:
    """Local improvement of the greedy estimate ``max_r (acc_r + warm_r)`` (spec 10): take the
    critical replica k; among every move of one of its sequences to another replica that
    holds it, and every swap of one of its sequences with one elsewhere, apply the one whose
    ``max(t_k', t_j')`` is smallest, if it is below ``t_k``. Stops when none is (or after
    ``max_steps``). Each accepted step lowers the sorted vector of replica times
    lexicographically, so the makespan never rises and the pass terminates. ``cost`` and
    ``warm`` are (sequences, replicas), ``inf`` cost where a sequence does not fit; a move
    never empties a replica."""
    rep = rep.copy()
    n, R = cost.shape
    if R < 2 or n < 2:
        return rep, 0
    idx_all = np.arange(n)
    steps = 0
    while steps < max_steps:
        acc, w = _times(cost, warm, rep, R)
        t = acc + w
        k = int(np.argmax(t))
        tk = t[k]
        eps = 1e-12 * max(1.0, tk)
        on_k = np.flatnonzero(rep == k)
        if len(on_k) < 1:
            break
        # warm of k without each of its sequences (top-2 over k's sequences)
        wk = warm[on_k, k]
        order = np.argsort(-wk, kind="stable")
        top1 = wk[order[0]]
        top2 = wk[order[1]] if len(on_k) > 1 else 0.0
        wk_wo = np.where(np.arange(len(on_k)) == order[0], top2, top1)
        # per replica: top-2 warm and its argmax sequence, for "without y" on the other side
        wr = warm[idx_all, rep]
        arg1 = np.full(R, -1)
        best1 = np.zeros(R)
        best2 = np.zeros(R)
        for i in np.argsort(-wr, kind="stable"):
            r = rep[i]
            if arg1[r] < 0:
                arg1[r], best1[r] = i, wr[i]
            elif best2[r] == 0.0 and wr[i] > 0.0:
                best2[r] = wr[i]
        best_v, best_op = tk - eps, None
        counts = np.bincount(rep, minlength=R)
        others = np.flatnonzero(rep != k)
        y_rep = rep[others]
        wy_wo = np.where(arg1[y_rep] == others, best2[y_rep], best1[y_rep])
        for a, x in enumerate(on_k):
            tk_new_base = acc[k] - cost[x, k]
            # moves: x to replica j (k keeps >= 1 sequence)
            if counts[k] > 1:
                tj = acc + cost[x] + np.maximum(w, warm[x])
                tk_new = tk_new_base + wk_wo[a]
                v = np.maximum(tj, tk_new)
                v[k] = np.inf
                j = int(np.argmin(v))
                if v[j] < best_v:
                    best_v, best_op = v[j], ("move", x, j)
            if len(others):
                # swaps: x <-> y (y on replica j != k)
                tk_s = tk_new_base + cost[others, k] + np.maximum(wk_wo[a], warm[others, k])
                tj_s = acc[y_rep] - cost[others, y_rep] + cost[x, y_rep] + np.maximum(wy_wo, warm[x, y_rep])
                v = np.maximum(tk_s, tj_s)
                b = int(np.argmin(v))
                if v[b] < best_v:
                    best_v, best_op = v[b], ("swap", x, int(others[b]))
        if best_op is None:
            break
        op, x, j = best_op
        if op == "move":
            rep[x] = j
        else:
            rep[x], rep[j] = rep[j], k
        steps += 1
    return rep, steps


def dispatch(lengths: Sequence[int], replicas: Sequence[ReplicaCost], shuffles: int = 100, seed: int = 0,
             includes_c: bool = True, refine: bool = True) -> Dispatch:
    lengths = [int(x) for x in lengths]
    _check(lengths, replicas, shuffles)
    R = len(replicas)
    order = sorted(range(R), key=lambda r: -replicas[r].cap)  # stable: caller order among equal caps
    caps = [replicas[r].cap for r in order]
    if lengths and max(lengths) > caps[0]:
        return Dispatch([[] for _ in range(R)], math.inf, False)
    pp1 = [replicas[r].pp - 1 for r in order]
    # cost[x][k]: sequence x on the k-th replica of ``order`` (ms), inf where it does not fit
    L = np.asarray(lengths, dtype=float)[:, None]
    a = np.array([replicas[r].a for r in order])
    b = np.array([replicas[r].b for r in order])
    c = np.array([replicas[r].c for r in order])
    capv = np.array(caps, dtype=float)
    cost = a * L * L + b * L
    warm_cost = cost.copy()
    if includes_c:
        cost = cost + c * L / capv
        warm_cost = warm_cost + c
    warm_cost = warm_cost * np.array(pp1, dtype=float)
    fits = L <= capv
    cost_l = np.where(fits, cost, np.inf).tolist()
    warm_l = warm_cost.tolist()
    fit_count = fits.sum(axis=1)
    fixed = [i for i in range(len(lengths)) if fit_count[i] == 1]
    rest = [i for i in range(len(lengths)) if fit_count[i] != 1]
    # a sequence fitting one replica only: the largest (replica order 0 or its capacity ties)
    best: tuple[float, list[list[int]], int] | None = None
    longest = fixed + sorted(rest, key=lambda i: (-lengths[i], i))
    for sh in range(shuffles + (1 if refine else 0)):
        if sh < shuffles:
            rng = np.random.default_rng([seed, sh])
            seq_order = fixed + [rest[i] for i in rng.permutation(len(rest))]
        else:
            seq_order, sh = longest, LONGEST_FIRST
        acc = [0.0] * R
        warm = [0.0] * R
        count = [0] * R
        got: list[list[int]] = [[] for _ in range(R)]
        gmax = 0.0
        for x in seq_order:
            cx, wx = cost_l[x], warm_l[x]
            best_v, pick, empty_pick = math.inf, -1, -1
            for k in range(R):
                ck = cx[k]
                if ck == math.inf:
                    continue
                v = acc[k] + ck + (warm[k] if warm[k] > wx[k] else wx[k])
                if v < gmax:
                    v = gmax
                if v < best_v:
                    best_v, pick = v, k
                    empty_pick = k if count[k] == 0 else -1
                elif v == best_v and count[k] == 0:
                    empty_pick = k
            if empty_pick >= 0:
                pick = empty_pick
            acc[pick] += cx[pick]
            if wx[pick] > warm[pick]:
                warm[pick] = wx[pick]
            count[pick] += 1
            got[pick].append(x)
            t = acc[pick] + warm[pick]
            if t > gmax:
                gmax = t
        if min(count) == 0:
            if sh == LONGEST_FIRST:
                continue  # not an order of the authors' rule: skipped, never a reason to drop
            return Dispatch([[] for _ in range(R)], math.inf, False, sh)
        if best is None or gmax < best[0]:
            best = (gmax, got, sh)
    assert best is not None
    span, groups, moves = best[0], best[1], 0
    if refine and R > 1:
        rep = np.empty(len(lengths), dtype=int)
        for k, g in enumerate(groups):
            rep[g] = k
        cost_np = np.where(fits, cost, np.inf)
        rep, moves = improve(cost_np, warm_cost, rep)
        if moves:
            acc, w = _times(cost_np, warm_cost, rep, R)
            new = float((acc + w).max())
            if new < span:  # the pass only accepts improvements; guard against rounding
                span = new
                groups = [np.flatnonzero(rep == k).tolist() for k in range(R)]
            else:
                moves = 0
    assign: list[list[int]] = [[] for _ in range(R)]
    for k, r in enumerate(order):
        assign[r] = sorted(groups[k])
    return Dispatch(assign, span, True, best[2], best[0], moves)


def token_balanced(lengths: Sequence[int], replicas: Sequence[ReplicaCost]) -> Dispatch:
    """[R] ablation (spec 3, hetero + token-balanced dispatch): longest first, each sequence to
    the fitting replica with the fewest tokens per GPU (ties: the first). Memory-balanced, not
    time-balanced; the makespan is reported by the same greedy estimate (includes_c=False)."""
    lengths = [int(x) for x in lengths]
    _check(lengths, replicas, 1)
    R = len(replicas)
    tokens = [0] * R
    got: list[list[int]] = [[] for _ in range(R)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        x = lengths[i]
        ok = [r for r in range(R) if replicas[r].cap >= x]
        if not ok:
            return Dispatch([[] for _ in range(R)], math.inf, False)
        r = min(ok, key=lambda r: (tokens[r] / replicas[r].gpus, r))
        tokens[r] += x
        got[r].append(i)
    if any(not g for g in got):
        return Dispatch([[] for _ in range(R)], math.inf, False)
    span = 0.0
    for r, g in enumerate(got):
        rc = replicas[r]
        costs = [rc.seq_cost(lengths[i]) for i in g]
        span = max(span, sum(costs) + (rc.pp - 1) * max(costs))
    return Dispatch([sorted(g) for g in got], span, True)
