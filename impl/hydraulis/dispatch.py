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
    shuffle: int = -1  # index of the winning shuffle (-1: none)


def _check(lengths: Sequence[int], replicas: Sequence[ReplicaCost], shuffles: int) -> None:
    if not replicas:
        raise ConfigError("dispatch: the candidate has no replicas")
    if shuffles < 1:
        raise ConfigError(f"system.shuffles: must be >= 1, got {shuffles}")
    if len(lengths) and min(lengths) < 1:
        raise ConfigError(f"dispatch: sequence lengths must be >= 1, got {min(lengths)}")


def dispatch(lengths: Sequence[int], replicas: Sequence[ReplicaCost], shuffles: int = 100, seed: int = 0,
             includes_c: bool = True) -> Dispatch:
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
    for sh in range(shuffles):
        rng = np.random.default_rng([seed, sh])
        seq_order = fixed + [rest[i] for i in rng.permutation(len(rest))]
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
            return Dispatch([[] for _ in range(R)], math.inf, False, sh)
        if best is None or gmax < best[0]:
            best = (gmax, got, sh)
    assert best is not None
    assign: list[list[int]] = [[] for _ in range(R)]
    for k, r in enumerate(order):
        assign[r] = sorted(best[1][k])
    return Dispatch(assign, best[0], True, best[2])


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
