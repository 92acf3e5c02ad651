"""Tensor-parallel groups of one node from its GPUs' rates (step 1 of Malleus's
planner, the authors' code Hetu `python/hetu/engine/strategy.py`; Elastor's reference code
splits a node the same way).

Healthy GPUs (by id) come first, then slow ones (by rate). The first groups are full (tp
GPUs); the last window of tp slots is split into descending powers of two from each start
size h0 (a group of tp / 2**k GPUs is at shrink level k), scored by sum 1/(y * w_k) with
y = alpha_k * max x and w_k = ``shrink_penalty[k]`` (w_0 = 1); GPUs left over are suspended.
With >= 2 slow GPUs in a node the window also slides left (shifted orders: the slowest GPUs
right of it are suspended). A node with fewer than a multiple of tp GPUs (some lost) puts its
remainder in the last window, so 7 healthy GPUs at tp=4 give 4 + 2 + 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from impl.common.api import ConfigError

from .plan import HEALTHY_BELOW, effective_rate

Rates = Union[Sequence[float], Mapping[int, float]]


@dataclass(frozen=True)
class TPGroup:
    """A planned group before placement: GPUs, node, shrink level k, rate y."""

    gpus: tuple[int, ...]
    node: int
    k: int
    y: float


def shrink_levels(tp: int) -> int:
    """Number of shrink levels of a TP degree (k = 0 .. log2(tp))."""
    return int(math.log2(tp)) + 1


def check_levels(name: str, values: Sequence[float], tp: int) -> None:
    """Per-shrink-level lists (alpha, shrink penalties) need one entry per level of ``tp``."""
    levels = shrink_levels(tp)
    if len(values) < levels:
        raise ConfigError(f"{name}: tp={tp} needs {levels} entries (k = 0..{levels - 1}), got {list(values)}")


def check_shrink_penalty(name: str, values: Sequence[float], tp: int) -> None:
    check_levels(name, values, tp)
    if values[0] != 1.0 or not all(w > 0 for w in values):
        raise ConfigError(f"{name}: level 0 (a full group) must be 1.0 and every level > 0, got {list(values)}")


def tp_group_rate(xs: Sequence[float], k: int, alpha: Sequence[float], healthy_below: float = HEALTHY_BELOW) -> float:
    return effective_rate(alpha[k] * max(xs), healthy_below)


def node_groups(gpus: Sequence[int], node: int, x: Rates, tp: int, alpha: Sequence[float],
                shrink_penalty: Sequence[float], healthy_below: float = HEALTHY_BELOW) -> tuple[list[TPGroup], list[int]]:
    """Groups and suspended GPUs of one node's available ``gpus`` under rates ``x[g]``."""
    ids = sorted(gpus)
    if not ids:
        return [], []
    xe = {g: effective_rate(x[g], healthy_below) for g in ids}
    healthy = [g for g in ids if xe[g] == 1.0]
    strag = sorted((g for g in ids if xe[g] > 1.0), key=lambda g: (x[g], g))
    order = healthy + strag
    windows = -(-len(order) // tp)
    if not strag and len(order) % tp == 0:
        return [TPGroup(tuple(order[i * tp:(i + 1) * tp]), node, 0, 1.0) for i in range(windows)], []
    fulls = range(windows - 1, -1, -1) if len(strag) >= 2 else [windows - 1]
    best, best_key = None, None
    for n_full in fulls:
        groups = [TPGroup(tuple(order[i * tp:(i + 1) * tp]), node, 0,
                          tp_group_rate([x[g] for g in order[i * tp:(i + 1) * tp]], 0, alpha, healthy_below))
                  for i in range(n_full)]
        window = order[n_full * tp:(n_full + 1) * tp]
        h0 = tp
        while h0 >= 1:
            split, pos, size, k = [], 0, h0, int(round(math.log2(tp // h0)))
            while size >= 1 and pos + size <= len(window):
                sub = tuple(window[pos:pos + size])
                split.append(TPGroup(sub, node, k, tp_group_rate([x[g] for g in sub], k, alpha, healthy_below)))
                pos += size
                size //= 2
                k += 1
            cand = groups + split
            used = {g for grp in cand for g in grp.gpus}
            score = math.fsum(1.0 / (grp.y * shrink_penalty[grp.k]) for grp in cand)
            key = round(score, 12)
            if best_key is None or key > best_key:
                best, best_key = (cand, sorted(set(ids) - used)), key
            h0 //= 2
    return best
