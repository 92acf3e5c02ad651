"""Per-step data dispatch over a heterogeneous deployment (the authors' code, Hetu `examples/lobra`), as data in,
data out.

A deployment is a list of :class:`ReplicaGroup` (a scheme and its replica count ``dp``). A step's
work is ``counts``: per bucket length s_i, the number of sequences N_i (over all tasks).
Dispatchers return a :class:`BucketDispatch`: ``n[i][j]`` sequences of bucket i to group j.

- :func:`balanced` (LobRA): the authors' ILP, minimising the slowest group's replica time
  ``T_j = Σ_i [t_j(mbs_ij, s_i)·m_ij + t_j(r_ij, s_i)·w_ij] + (pp_j−1)·B_j`` where each replica
  of j runs m_ij full micro-batches and one remainder of r_ij sequences (the ceil split of
  n_ij over dp_j replicas). Solved with scipy's HiGHS (``scipy.optimize.milp``) under a time
  limit and a relative gap; the incumbent is kept on a limit; no incumbent falls back to
  :func:`length_based`. The objective is recomputed from the integers, never read back.
- :func:`length_based` (GROUP): each length goes to the group with the smallest max_tokens >=
  s, split evenly over its replicas.
- :func:`even`: homogeneous deployments (Task-Fused): every bucket split evenly over all
  replicas.
Then :func:`split_samples` turns counts into each replica's sequences (per bucket, fill the
groups in order from the tasks in order; each replica of a group takes ⌈n/dp⌉ of the group's
share), and :func:`micro_batches` cuts a replica's sequences into full micro-batches plus one
remainder per bucket (fused: tasks mixed, sorted by length; single: one task per micro-batch).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from impl.common.api import ConfigError

from impl.lobra.cost.replica import Scheme, replica_time

class Dispatcher(enum.StrEnum):
    """How a step's sequences go to replicas: the balanced ILP (LobRA), by length, or evenly."""

    balanced = "balanced"
    length = "length"
    even = "even"


DISPATCHERS = tuple(Dispatcher)


@dataclass(frozen=True)
class ReplicaGroup:
    scheme: Scheme
    dp: int

    @property
    def gpus(self) -> int:
        return self.dp * self.scheme.gpus


@dataclass
class BucketDispatch:
    n: list[list[int]]  # [bucket][group]
    objective_s: float  # max_j T_j recomputed from the integers
    group_time_s: list[float]
    status: str = "optimal"  # optimal | time_limit | fallback_length | length | even
    gap: float = 0.0
    solve_s: float = 0.0
    info: dict = field(default_factory=dict)


def per_replica(n: int, dp: int) -> int:
    """The busiest replica's share of a ceil split of n over dp replicas."""
    return -(-n // dp)


def group_time(g: ReplicaGroup, buckets: Sequence[int], n_col: Sequence[int]) -> float:
    """T_j of one replica of g (the busiest: each gets ⌈n_ij/dp⌉ sequences of bucket i)."""
    mbs = []
    for s, n in zip(buckets, n_col):
        k = per_replica(int(n), g.dp)
        if k == 0:
            continue
        cap = g.scheme.mbs(s)
        if cap < 1:
            raise ConfigError(f"dispatch: bucket {s} does not fit {g.scheme.label} (max_tokens {g.scheme.max_tokens})")
        mbs += [(cap, s)] * (k // cap) + ([(k % cap, s)] if k % cap else [])
    return replica_time(g.scheme, mbs)


def _result(groups, buckets, n, status, **kw) -> BucketDispatch:
    times = [group_time(g, buckets, [n[i][j] for i in range(len(buckets))]) for j, g in enumerate(groups)]
    return BucketDispatch(n=n, objective_s=max(times), group_time_s=times, status=status, **kw)


def check_counts(groups: Sequence[ReplicaGroup], buckets: Sequence[int], counts: Sequence[int]) -> None:
    if len(buckets) != len(counts):
        raise ConfigError(f"dispatch: {len(buckets)} buckets but {len(counts)} counts")
    top = max(g.scheme.max_tokens for g in groups)
    for s, c in zip(buckets, counts):
        if c and s > top:
            raise ConfigError(f"dispatch: bucket length {s} is beyond every replica's max_tokens (largest {top})")


def length_based(groups: Sequence[ReplicaGroup], buckets: Sequence[int], counts: Sequence[int]) -> BucketDispatch:
    check_counts(groups, buckets, counts)
    n = [[0] * len(groups) for _ in buckets]
    for i, (s, c) in enumerate(zip(buckets, counts)):
        fits = [j for j, g in enumerate(groups) if g.scheme.max_tokens >= s]
        j = min(fits, key=lambda j: (groups[j].scheme.max_tokens, j))
        n[i][j] = int(c)
    return _result(groups, buckets, n, "length")


def even(groups: Sequence[ReplicaGroup], buckets: Sequence[int], counts: Sequence[int]) -> BucketDispatch:
    """Homogeneous replicas: group j gets its replica share of every bucket (largest remainder)."""
    check_counts(groups, buckets, counts)
    dp = [g.dp for g in groups]
    tot = sum(dp)
    n = [[0] * len(groups) for _ in buckets]
    for i, c in enumerate(counts):
        for j in range(len(groups)):
            if groups[j].scheme.max_tokens < buckets[i]:
                raise ConfigError(f"dispatch: even split needs every replica to fit bucket {buckets[i]}, "
                                  f"{groups[j].scheme.label} does not")
        base = [c * d // tot for d in dp]
        rest = c - sum(base)
        order = sorted(range(len(groups)), key=lambda j: -(c * dp[j] % tot))
        for j in order[:rest]:
            base[j] += 1
        n[i] = base
    return _result(groups, buckets, n, "even")


def balanced(groups: Sequence[ReplicaGroup], buckets: Sequence[int], counts: Sequence[int], *,
             time_limit_s: float = 5.0, mip_gap: float = 0.005, every_group_works: bool = True) -> BucketDispatch:
    """The balanced-dispatch ILP (see the module doc); falls back to :func:`length_based` without an incumbent."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    check_counts(groups, buckets, counts)
    t0 = time.perf_counter()
    I, J = len(buckets), len(groups)
    var_lo, var_hi, integ, names = [], [], [], []

    def var(name, lo, hi, is_int):
        names.append(name)
        var_lo.append(lo)
        var_hi.append(hi)
        integ.append(1 if is_int else 0)
        return len(names) - 1

    z = var("z", 0, np.inf, False)
    cells = {}
    for i, (s, N) in enumerate(zip(buckets, counts)):
        if N == 0:
            continue
        for j, g in enumerate(groups):
            mbs = g.scheme.mbs(s)
            if mbs < 1:
                continue
            mmax = per_replica(N, g.dp) // mbs + 1
            cells[i, j] = dict(mbs=mbs, n=var(f"n{i}_{j}", 0, N, True), m=var(f"m{i}_{j}", 0, mmax, True),
                               r=var(f"r{i}_{j}", 0, mbs - 1, True), u=var(f"u{i}_{j}", 0, 1, True),
                               w=var(f"w{i}_{j}", 0, 1, True), mmax=mmax)
    Bv = {j: var(f"B{j}", 0, np.inf, False) for j, g in enumerate(groups) if g.scheme.pp > 1}
    rows, lo, hi = [], [], []

    def row(coefs: dict, l, h):
        rows.append(coefs)
        lo.append(l)
        hi.append(h)

    for i, N in enumerate(counts):
        if N:
            row({cells[i, j]["n"]: 1 for j in range(J) if (i, j) in cells}, N, N)
    if every_group_works and sum(counts) >= J:
        for j in range(J):
            row({cells[i, j]["n"]: 1 for i in range(I) if (i, j) in cells}, 1, np.inf)
    for (i, j), c in cells.items():
        dp, mbs, s = groups[j].dp, c["mbs"], buckets[i]
        sch = groups[j].scheme
        # n <= dp (m mbs + r) <= n + dp - 1
        row({c["m"]: dp * mbs, c["r"]: dp, c["n"]: -1}, 0, dp - 1)
        row({c["r"]: 1, c["w"]: -(mbs - 1)}, -np.inf, 0)
        row({c["r"]: 1, c["w"]: -1}, 0, np.inf)
        row({c["m"]: 1, c["u"]: -c["mmax"]}, -np.inf, 0)
        row({c["m"]: 1, c["u"]: -1}, 0, np.inf)
        if j in Bv:
            row({Bv[j]: 1, c["u"]: -sch.t(mbs, s)}, 0, np.inf)
            row({Bv[j]: 1, c["r"]: -sch.alpha(s), c["w"]: -sch.beta(s)}, 0, np.inf)
    for j, g in enumerate(groups):
        coef = {z: 1.0}
        for i in range(I):
            if (i, j) in cells:
                c, s = cells[i, j], buckets[i]
                coef[c["m"]] = coef.get(c["m"], 0) - g.scheme.t(c["mbs"], s)
                coef[c["r"]] = coef.get(c["r"], 0) - g.scheme.alpha(s)
                coef[c["w"]] = coef.get(c["w"], 0) - g.scheme.beta(s)
        if j in Bv:
            coef[Bv[j]] = -(g.scheme.pp - 1)
        row(coef, 0, np.inf)
    A = np.zeros((len(rows), len(names)))
    for k, coefs in enumerate(rows):
        for v, a in coefs.items():
            A[k, v] += a
    cost = np.zeros(len(names))
    cost[z] = 1.0
    # A tiny preference for fewer/shorter micro-batches breaks ties among equal makespans.
    for (i, j), c in cells.items():
        cost[c["m"]] += 1e-9
    res = milp(cost, integrality=np.array(integ), bounds=Bounds(var_lo, var_hi),
               constraints=LinearConstraint(A, lo, hi),
               options={"time_limit": float(time_limit_s), "mip_rel_gap": float(mip_gap), "disp": False})
    solve_s = time.perf_counter() - t0
    if res.x is None:
        d = length_based(groups, buckets, counts)
        d.status, d.solve_s = "fallback_length", solve_s
        d.info["solver_message"] = str(res.message)
        return d
    x = np.rint(res.x).astype(np.int64)
    n = [[int(x[cells[i, j]["n"]]) if (i, j) in cells else 0 for j in range(J)] for i in range(I)]
    status = "optimal" if res.status == 0 else "time_limit"
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    d = _result(groups, buckets, n, status, gap=gap, solve_s=solve_s)
    d.info["solver_objective_s"] = float(res.fun)
    return d


def dispatch(kind: str, groups, buckets, counts, **kw) -> BucketDispatch:
    if kind == "balanced":
        return balanced(groups, buckets, counts, **kw)
    if kind == "length":
        return length_based(groups, buckets, counts)
    if kind == "even":
        return even(groups, buckets, counts)
    raise ConfigError(f"system.dispatch: unknown {kind!r} (one of: {', '.join(DISPATCHERS)})")


# ---- from counts to sequences ----------------------------------------------------------------
def split_samples(samples_by_bucket: Sequence[Sequence], groups: Sequence[ReplicaGroup],
                  d: BucketDispatch) -> list[list[list]]:
    """``out[j][k]``: the samples of replica k of group j. ``samples_by_bucket[i]`` holds bucket
    i's samples in task order (the authors' fill rule); counts are conserved exactly."""
    out = [[[] for _ in range(g.dp)] for g in groups]
    for i, seqs in enumerate(samples_by_bucket):
        if sum(d.n[i]) != len(seqs):
            raise ValueError(f"dispatch: bucket {i} has {len(seqs)} sequences but {sum(d.n[i])} dispatched")
        off = 0
        for j, g in enumerate(groups):
            share = list(seqs[off:off + d.n[i][j]])
            off += d.n[i][j]
            k = per_replica(len(share), g.dp) if share else 0
            for r in range(g.dp):
                out[j][r] += share[r * k:(r + 1) * k]
    return out


def micro_batches(samples: Sequence, bucket_of, scheme: Scheme, mode: str = "fused") -> list[tuple[int, list]]:
    """``[(bucket length, samples)]``: per bucket, full micro-batches of ``scheme.mbs(s)`` then a
    remainder. ``bucket_of(sample) -> s``; fused mixes tasks (sorted by length), single keeps one
    task per micro-batch (sorted by task, then length)."""
    by: dict[int, list] = {}
    for x in samples:
        by.setdefault(bucket_of(x), []).append(x)
    out = []
    for s in sorted(by):
        cap = scheme.mbs(s)
        if cap < 1:
            raise ConfigError(f"dispatch: bucket {s} does not fit {scheme.label} (max_tokens {scheme.max_tokens})")
        seqs = by[s]
        if mode == "fused":
            chunks = [sorted(seqs, key=lambda x: (x.length, x.task, x.seq_id))]
        else:
            tasks = list(dict.fromkeys(x.task for x in seqs))
            chunks = [sorted((x for x in seqs if x.task == t), key=lambda x: (x.length, x.seq_id)) for t in tasks]
        for ch in chunks:
            out += [(s, ch[a:a + cap]) for a in range(0, len(ch), cap)]
    return out
