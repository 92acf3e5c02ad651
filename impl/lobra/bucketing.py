"""Bucketing of one step's lengths (the authors' dynamic bucketing, Hetu `examples/lobra`, as the
artifact github.com/ccchengff/LobRA runs it).

- :func:`dynamic_buckets`: candidates are the lengths rounded up to a multiple of ``align``
  (16); a DP over the sorted distinct candidates picks at most ``max_buckets`` boundaries
  (strictly increasing, the largest candidate always one of them) minimising the total padding
  ``Σ (bucket(x) − x)``::

      pad[j][i] = min_k pad[j−1][k] + cand_i·(cnt_i − cnt_k) − (sum_i − sum_k)

  (cnt, sum: prefix count and prefix token sum of the lengths up to candidate i). B is a
  maximum, not an exact count. ``min_len`` (the original code's 256 floor, off by default:
  the artifact applies none) raises every bucket to at least that many tokens. ``cuts`` (the deployment's
  max_tokens, :func:`impl.lobra.joint_step.plan_bucketed`) are boundaries no bucket may straddle:
  a bucket spanning a replica's max_tokens would pad sequences that fit the smaller replica
  past its limit, so only the larger replicas could take them (the dispatcher never sees that
  they fit).
- :func:`fixed_buckets`: the baselines' static set, e.g. {256, 512, ..., 16384} (7 buckets).
- :func:`assign`: the bucket of every length (the smallest boundary >= it).
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from impl.common.api import ConfigError


def candidates(lengths: Sequence[int], align: int = 16) -> np.ndarray:
    x = np.asarray(lengths, dtype=np.int64)
    return np.unique(-(-x // align) * align)


def padding(lengths: Sequence[int], boundaries: Sequence[int], min_len: int = 0) -> int:
    """Total padding tokens of ``lengths`` under ``boundaries``."""
    return int(sum(max(b, min_len) - int(x) for x, b in zip(lengths, assign(lengths, boundaries))))


def assign(lengths: Sequence[int], boundaries: Sequence[int]) -> list[int]:
    bs = sorted(int(b) for b in boundaries)
    out = []
    for x in lengths:
        k = bisect.bisect_left(bs, int(x))
        if k == len(bs):
            raise ConfigError(f"bucketing: length {int(x)} is above the largest bucket {bs[-1]}")
        out.append(bs[k])
    return out


def dynamic_buckets(lengths: Sequence[int], max_buckets: int = 16, align: int = 16,
                    min_len: int = 0, cuts: Sequence[int] = ()) -> list[int]:
    """Boundaries (ascending, at most ``max_buckets``) minimising total padding, no bucket
    straddling a value of ``cuts``; see the module doc."""
    if max_buckets < 1:
        raise ConfigError(f"system.num_buckets: must be >= 1, got {max_buckets}")
    if align < 1:
        raise ConfigError(f"system.bucket_align: must be >= 1, got {align}")
    x = np.sort(np.asarray(lengths, dtype=np.int64))
    if len(x) == 0:
        raise ConfigError("bucketing: no lengths in the step")
    cand = candidates(x, align)
    if min_len:
        cand = np.unique(np.maximum(cand, min_len))
    # Only cuts with lengths on both sides bind; each becomes a candidate a bucket may end at.
    cuts = sorted({int(f) for f in cuts if cand[0] < int(f) < cand[-1]})
    if len(cuts) + 1 > max_buckets:
        raise ConfigError(f"system.num_buckets: {max_buckets} buckets cannot keep the {len(cuts)} replica "
                          f"max_tokens cuts {cuts} apart (need >= {len(cuts) + 1})")
    cand = np.unique(np.concatenate([cand, np.asarray(cuts, dtype=np.int64)]))
    # Prefix count and token sum of the lengths <= each candidate (index 0 = nothing).
    pos = np.searchsorted(x, cand, side="right")
    csum = np.concatenate([[0], np.cumsum(x)])
    cnt = np.concatenate([[0], pos]).astype(np.float64)
    tok = np.concatenate([[0], csum[pos]]).astype(np.float64)
    c = np.concatenate([[0], cand]).astype(np.float64)
    n = len(cand)
    INF = float("inf")
    # cost[k, i]: one bucket at candidate i holding the lengths in (cand_k, cand_i], k < i.
    k_idx = np.arange(n + 1)[:, None]
    i_idx = np.arange(n + 1)[None, :]
    cost = c[None, :] * (cnt[None, :] - cnt[:, None]) - (tok[None, :] - tok[:, None])
    ok = k_idx < i_idx
    for f in cuts:  # (c_k, c_i] must not hold f strictly inside
        ok &= ~((c[:, None] < f) & (c[None, :] > f))
    cost = np.where(ok, cost, INF)
    pad = np.full(n + 1, INF)
    pad[0] = 0.0
    back = []
    best_j, best = 0, INF
    for j in range(1, min(max_buckets, n) + 1):
        tot = pad[:, None] + cost
        arg = np.argmin(tot, axis=0)
        pad = tot[arg, np.arange(n + 1)]
        back.append(arg)
        if pad[n] < best - 1e-9:
            best, best_j = pad[n], j
    bounds, i = [], n
    for j in range(best_j, 0, -1):
        bounds.append(int(c[i]))
        i = int(back[j - 1][i])
    # A cut with no lengths between it and the boundary below is an empty bucket: drop it.
    bounds = sorted(bounds)
    return [b for k, b in enumerate(bounds) if np.any((x > (bounds[k - 1] if k else 0)) & (x <= b))]


def fixed_buckets(max_len: int, smallest: int = 256, count: int = 7) -> list[int]:
    """``count`` powers-of-two buckets ending at ``max_len`` (e.g. 256 ... 16384), smallest first;
    the largest is raised to ``max_len`` when that is not a power of two."""
    if count < 1 or smallest < 1:
        raise ConfigError(f"system.fixed_buckets: count {count} and smallest {smallest} must be >= 1")
    out = [smallest << k for k in range(count)]
    if out[-1] < max_len:
        raise ConfigError(f"system.fixed_buckets: {count} buckets from {smallest} end at {out[-1]} < the longest "
                          f"sequence {max_len}")
    return out
