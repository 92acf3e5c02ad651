"""Profiling the replica kinds in the job itself (README "Real mode": (a, b, c) fitted per replica
from timed micro-batches of 64…2048 tokens), before the measured steps.

Every rank times the same kind at the same time, so the fit sees the concurrency of a training
step (both cores busy), the kinds interleaved row by row. Rows: one sequence of each ``fit_lengths`` entry up to the kind's cap,
plus packed rows ``count x length`` (which separate the quadratic term, Σ s², from the linear
one, Σ s), each timed ``fit_repeats`` times after one untimed warm-up pass over all rows (a row's
first run pays the allocator's first touch of its activations, which no training step sees). The least-squares
fit is :func:`~impl.common.cost.seqlen.fit_seq_cost` over (Σ s, Σ s², seconds) of every rank's
rows; the planner consumes it as a :class:`~impl.hydraulis.cost.strategy.ReplicaCost` in ms.
"""
from __future__ import annotations

import statistics
from typing import Mapping, Sequence

import torch.distributed as dist

from impl.common.cost.seqlen import SeqCost, fit_seq_cost
from impl.common.varlen.packing import MicroBatch

from impl.hydraulis.real.config import HydraulisRealKnobs, ReplicaKind
from impl.hydraulis.real.replica import ReplicaModel

FIT_IDS = 1 << 40  # sequence ids of profiling rows, far from the training stream's


def fit_rows(kind: ReplicaKind, knobs: HydraulisRealKnobs) -> list[MicroBatch]:
    rows, nid = [], FIT_IDS
    shapes = [[1, int(s)] for s in knobs.fit_lengths] + [[int(n), int(s)] for n, s in knobs.pack_rows]
    for n, s in shapes:
        if n * s > kind.cap:
            continue
        rows.append(MicroBatch(tuple(range(nid, nid + n)), (s,) * n, n * s))
        nid += n
    return rows


def profile(models: Mapping[str, ReplicaModel], rows: Mapping[str, Sequence[MicroBatch]],
            repeats: int) -> dict[str, list[tuple[int, int, float]]]:
    """(Σ s, Σ s², seconds) per timed row and kind. The kinds are interleaved row by row, so a
    drift of the host's load between the start and the end of profiling hits every kind alike
    (the planner acts on their ratio); barriers keep the ranks in step."""
    out: dict[str, list] = {k: [] for k in rows}
    for k, rs in rows.items():  # warm-up, untimed: every row shape once (first-touch allocations)
        for mb in rs:
            models[k].run([mb], mb.num_tokens, f"fit {k}")
    for _ in range(repeats):
        for i in range(max(len(rs) for rs in rows.values())):
            for k, rs in rows.items():
                if i < len(rs):
                    dist.barrier()
                    out[k].extend(models[k].run([rs[i]], rs[i].num_tokens, f"fit {k}").mb_times_s)
    return out


def row_medians(samples: Sequence[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """One point per row shape: the median of its timings over repeats and ranks (a shared host
    adds one-sided outliers; the median keeps the typical time a training step also sees)."""
    by: dict[tuple[int, int], list[float]] = {}
    for tok, sq, t in samples:
        by.setdefault((int(tok), int(sq)), []).append(float(t))
    return [(tok, sq, statistics.median(ts)) for (tok, sq), ts in sorted(by.items())]


def fit_kind(kind: ReplicaKind, samples: Sequence[tuple[int, int, float]], min_r2: float) -> SeqCost:
    pts = row_medians(samples)
    return fit_seq_cost([p[0] for p in pts], [p[2] for p in pts], sq_lengths=[p[1] for p in pts],
                        min_r2=min_r2, field=f"system.real.kinds[{kind.name}] cost fit")
