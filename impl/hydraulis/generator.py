"""Hydraulis' offline strategy generator (the authors' code, Hetu
``examples/hydraulis/strategy/``): a DP over (GPUs, max length)
on the dataset's length histogram, backtracked into heterogeneous replica lists, deduplicated
into the candidate pool (the homogeneous optimizer-layout strategy first).

Lengths are bucketed by ``step`` tokens (S_STEP: 128 for 7B/13B, 1024 for 32B); bucket i holds
lengths in ``((i−1)·step, i·step]``. With ``cnt`` the (per-step) histogram and
``T_k(x) = a_k x² + b_k x + c_k``:

    t[n][0] = 0,  t[0][s>0] = inf
    t[n][s] = min( t[n−ΔN][s],
                   min_{k: maxlen_k ≥ s·step, g_k ≤ n} min_{1≤l≤s, d≥1, d·g_k≤n}
                       max( t[n−d·g_k][s−l], Cost_k(s−l, s] / d ) )
    Cost_k(lo, hi] = Σ_{x∈(lo,hi]} cnt[x]·T_k(x) + (pp_k − 1)·T_k(max x in the range)

(Bucket sums use the exact Σx, Σx² of the sampled lengths, and "max x" is the longest sampled
length of the range; an empty range costs 0.) ``maxlen_k`` is the unrounded capacity, as theirs.
Backtracking ``trace[N][s]`` for every s with data gives one replica list per s, for steps
whose longest sequence is at most s·step; GPUs the list leaves unused (the ``t[n−ΔN]`` branch)
are filled [R] with replicas of the largest strategy that fits the remainder and holds the
list's longest range, so every list has Σ tp·pp = N. Lists are deduplicated as multisets in
descending-s order and capped at ``max_candidates`` ([R] ≤ 6, README "Design choices for the [R] details"; evenly spaced over s, the
largest s kept).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from impl.common.api import ConfigError

from impl.hydraulis.cost.strategy import ReplicaCost, fmt_strategy


@dataclass(frozen=True)
class Histogram:
    """Per-bucket count, Σx, Σx² and longest length (``step`` tokens per bucket; bucket 0 unused)."""

    step: int
    count: np.ndarray
    sum_x: np.ndarray
    sum_x2: np.ndarray
    max_x: np.ndarray

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], step: int, weight: float = 1.0) -> "Histogram":
        if step < 1:
            raise ConfigError(f"system.generator_step: must be >= 1, got {step}")
        x = np.asarray(lengths, dtype=np.int64)
        if len(x) == 0:
            raise ConfigError("generator: the length sample is empty")
        if x.min() < 1:
            raise ConfigError(f"generator: lengths must be >= 1, got {int(x.min())}")
        nb = int(math.ceil(x.max() / step))
        b = (x + step - 1) // step  # bucket of each length, 1..nb
        xf = x.astype(float)
        count = np.bincount(b, minlength=nb + 1).astype(float) * weight
        sx = np.bincount(b, weights=xf, minlength=nb + 1) * weight
        sx2 = np.bincount(b, weights=xf * xf, minlength=nb + 1) * weight
        mx = np.zeros(nb + 1)
        np.maximum.at(mx, b, xf)
        return cls(step, count, sx, sx2, mx)

    @classmethod
    def from_counts(cls, lengths: Sequence[int], counts: Sequence[float], step: int) -> "Histogram":
        """From a ``length, count`` table (counts may be fractional: per-step averages)."""
        c = np.asarray(counts, dtype=float)
        if (c < 0).any():
            i = int(np.argmax(c < 0))
            raise ConfigError(f"generator histogram: count of length {int(lengths[i])} is negative ({c[i]:g})")
        x = np.asarray(lengths, dtype=np.int64)
        keep = c > 0
        x, c = x[keep], c[keep]
        if len(x) == 0:
            raise ConfigError("generator histogram: every count is 0")
        nb = int(math.ceil(x.max() / step))
        b = (x + step - 1) // step
        xf = x.astype(float)
        count = np.bincount(b, weights=c, minlength=nb + 1)
        sx = np.bincount(b, weights=c * xf, minlength=nb + 1)
        sx2 = np.bincount(b, weights=c * xf * xf, minlength=nb + 1)
        mx = np.zeros(nb + 1)
        np.maximum.at(mx, b, xf)
        return cls(step, count, sx, sx2, mx)

    @property
    def buckets(self) -> int:
        return len(self.count) - 1


def range_costs(h: Histogram, r: ReplicaCost) -> np.ndarray:
    """C[lo, hi] = Cost_k(lo, hi] for bucket indices 0 <= lo < hi <= B (inf elsewhere)."""
    B = h.buckets
    per = r.a * h.sum_x2 + r.b * h.sum_x + r.c * h.count
    pref = np.concatenate([[0.0], np.cumsum(per[1:])])  # pref[i] = Σ buckets 1..i
    C = pref[None, :] - pref[:, None]
    # longest length in (lo, hi]: running max over hi for each lo
    mx = np.zeros((B + 1, B + 1))
    for lo in range(B):
        mx[lo, lo + 1:] = np.maximum.accumulate(h.max_x[lo + 1:])
    tmax = np.where(mx > 0, r.a * mx * mx + r.b * mx + r.c, 0.0)
    C = C + (r.pp - 1) * tmax
    lo_i, hi_i = np.indices((B + 1, B + 1))
    return np.where(lo_i < hi_i, C, np.inf)


@dataclass(frozen=True)
class Pool:
    candidates: list  # list[list[ReplicaCost]], the optimizer-layout strategy first
    sources: list  # per candidate: "optimizer_layout" or "dp@s=<tokens>"
    makespans: list  # per candidate: the DP's makespan estimate (ms), nan for the layout
    raw_lists: int  # lists before dedup / cap

    def describe(self) -> list[str]:
        return [f"{i}: {fmt_strategy(c)}  [{src}]" for i, (c, src) in enumerate(zip(self.candidates, self.sources))]


def dp_table(h: Histogram, strategies: Sequence[ReplicaCost], num_gpus: int, maxlen: Sequence[float],
             delta_n: int = 1):
    """The DP ``t[n][s]`` and its trace. ``trace[n][s]`` = None (use t[n−ΔN][s]) or (k, l, d)."""
    B = h.buckets
    t = np.full((num_gpus + 1, B + 1), np.inf)
    t[:, 0] = 0.0
    trace: list[list[Optional[tuple[int, int, int]]]] = [[None] * (B + 1) for _ in range(num_gpus + 1)]
    costs = [range_costs(h, r) for r in strategies]
    if num_gpus % delta_n:
        raise ConfigError(f"system.generator_delta_n: {delta_n} does not divide workload.num_gpus {num_gpus}")
    for n in range(delta_n, num_gpus + 1, delta_n):
        best = t[n - delta_n].copy()
        arg: list[Optional[tuple[int, int, int]]] = [None] * (B + 1)
        for k, r in enumerate(strategies):
            g = r.gpus
            if g > n or g % delta_n:
                continue
            s_ok = int(min(B, math.floor(maxlen[k] / h.step)))  # the largest bucket it holds
            if s_ok < 1:
                continue
            D = n // g
            d = np.arange(1, D + 1)
            prev = t[n - d * g]  # (D, lo)
            # M[d, lo, s] = max(t[n − d·g][lo], Cost_k(lo, s] / d), s in 1..s_ok
            M = np.maximum(prev[:, :, None], costs[k][None, :, 1:s_ok + 1] / d[:, None, None])
            flat = M.reshape(D * (B + 1), s_ok)
            am = np.argmin(flat, axis=0)
            val = flat[am, np.arange(s_ok)]
            for j in np.nonzero(val < best[1:s_ok + 1])[0]:
                s_ = j + 1
                dd, lo = divmod(int(am[j]), B + 1)
                best[s_] = val[j]
                arg[s_] = (k, s_ - lo, dd + 1)
        t[n] = best
        trace[n] = arg
    return t, trace


def backtrack(trace, t, strategies: Sequence[ReplicaCost], n: int, s: int, delta_n: int = 1) -> list[tuple[int, int]]:
    """(strategy index, count) pairs of the list ``trace[n][s]`` stands for."""
    out: list[tuple[int, int]] = []
    while s > 0 and n > 0:
        step = trace[n][s]
        if step is None:
            n -= delta_n
            continue
        k, l, d = step
        out.append((k, d))
        n -= d * strategies[k].gpus
        s -= l
    if s > 0:
        raise ConfigError(f"generator: no strategy list covers lengths up to bucket {s} with the GPUs left")
    return out


def _fill(counts: dict[int, int], strategies: Sequence[ReplicaCost], num_gpus: int) -> Optional[dict[int, int]]:
    used = sum(strategies[k].gpus * d for k, d in counts.items())
    left = num_gpus - used
    out = dict(counts)
    # the largest-capacity strategy among those used decides what "holds the list" means
    while left > 0:
        fit = [k for k, r in enumerate(strategies) if r.gpus <= left]
        if not fit:
            return None
        k = max(fit, key=lambda k: (strategies[k].gpus, strategies[k].cap, -k))
        out[k] = out.get(k, 0) + 1
        left -= strategies[k].gpus
    return out


def generate_pool(h: Histogram, strategies: Sequence[ReplicaCost], num_gpus: int,
                  layout_candidate: Sequence[ReplicaCost], *, maxlen: Optional[Sequence[float]] = None,
                  delta_n: int = 1, max_candidates: int = 6, min_s: int = 1) -> Pool:
    """The candidate pool; ``maxlen`` per strategy defaults to its (rounded) ``cap``."""
    if max_candidates < 0:
        raise ConfigError(f"system.max_candidates: must be >= 0, got {max_candidates}")
    if sum(r.gpus for r in layout_candidate) != num_gpus:
        raise ConfigError(f"system.opt_layout: its replicas use {sum(r.gpus for r in layout_candidate)} GPUs, "
                          f"not workload.num_gpus {num_gpus}")
    ml = list(maxlen) if maxlen is not None else [r.cap for r in strategies]
    longest = float(h.max_x.max())
    if max(ml, default=0) < longest:
        raise ConfigError(f"strategy pool: no strategy holds the longest sequence ({int(longest)} tokens > "
                          f"largest capacity {int(max(ml, default=0))})")
    t, trace = dp_table(h, strategies, num_gpus, ml, delta_n)
    seen: set = set()
    lists, srcs, spans = [], [], []
    raw = 0
    for s in range(h.buckets, min_s - 1, -1):
        if h.count[s] <= 0 or not math.isfinite(t[num_gpus][s]):
            continue
        raw += 1
        got = _fill(dict(_merge(backtrack(trace, t, strategies, num_gpus, s, delta_n))), strategies, num_gpus)
        if got is None:
            continue
        key = tuple(sorted(got.items()))
        if key in seen:
            continue
        seen.add(key)
        reps = [strategies[k] for k, d in sorted(got.items(), key=lambda kd: (-strategies[kd[0]].cap, kd[0]))
                for _ in range(d)]
        lists.append(reps)
        srcs.append(f"dp@s<={s * h.step}")
        spans.append(float(t[num_gpus][s]))
    layout_key = tuple(sorted((r.tp, r.pp) for r in layout_candidate))
    keep = [i for i, c in enumerate(lists) if tuple(sorted((r.tp, r.pp) for r in c)) != layout_key]
    if len(keep) > max_candidates:
        pick = sorted({keep[round(j * (len(keep) - 1) / max(1, max_candidates - 1))] for j in range(max_candidates)})
        keep = pick
    return Pool([list(layout_candidate)] + [lists[i] for i in keep], ["optimizer_layout"] + [srcs[i] for i in keep],
                [math.nan] + [spans[i] for i in keep], raw)


def _merge(pairs: Sequence[tuple[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for k, d in pairs:
        out[k] = out.get(k, 0) + d
    return out


def brute_force(h: Histogram, strategies: Sequence[ReplicaCost], num_gpus: int, maxlen: Sequence[float],
                s: Optional[int] = None) -> float:
    """The DP's optimum by exhaustive search over ordered partitions of buckets 1..s into
    ranges, each given a (strategy, d) pair, GPUs summing to <= N (tests only: tiny inputs)."""
    s = h.buckets if s is None else s
    costs = [range_costs(h, r) for r in strategies]
    best = math.inf

    def go(hi: int, n_left: int, span: float) -> None:
        nonlocal best
        if span >= best:
            return
        if hi == 0:
            best = span
            return
        for lo in range(hi):
            for k, r in enumerate(strategies):
                if maxlen[k] < hi * h.step:
                    continue
                for d in range(1, n_left // r.gpus + 1):
                    go(lo, n_left - d * r.gpus, max(span, costs[k][lo, hi] / d))

    go(s, num_gpus, 0.0)
    return best
