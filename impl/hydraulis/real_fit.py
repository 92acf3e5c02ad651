"""Profiling the replica kinds in the job itself (spec hydraulis 5: "fit (a, b, c) per replica
from timed micro-batches of 64…2048 tokens"), before the measured steps.

Every rank times the same kind at the same time, so the fit sees the concurrency of a training
step (both cores busy). Rows: one sequence of each ``fit_lengths`` entry up to the kind's cap,
plus packed rows ``count x length`` (which separate the quadratic term, Σ s², from the linear
one, Σ s), each timed ``fit_repeats`` times after one untimed warm-up row. The least-squares
fit is :func:`~impl.common.cost.seqlen.fit_seq_cost` over (Σ s, Σ s², seconds) of every rank's
rows; the planner consumes it as a :class:`~impl.hydraulis.cost.ReplicaCost` in ms.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from impl.common.cost.seqlen import SeqCost, fit_seq_cost
from impl.common.varlen.packing import MicroBatch

from .real_config import RealKnobs, ReplicaKind
from .real_replica import ReplicaModel

FIT_IDS = 1 << 40  # sequence ids of profiling rows, far from the training stream's


def fit_rows(kind: ReplicaKind, knobs: RealKnobs) -> list[MicroBatch]:
    rows, nid = [], FIT_IDS
    shapes = [[1, int(s)] for s in knobs.fit_lengths] + [[int(n), int(s)] for n, s in knobs.pack_rows]
    for n, s in shapes:
        if n * s > kind.cap:
            continue
        rows.append(MicroBatch(tuple(range(nid, nid + n)), (s,) * n, n * s))
        nid += n
    return rows


def time_kind(model: ReplicaModel, rows: Sequence[MicroBatch], repeats: int) -> list[tuple[int, int, float]]:
    """(Σ s, Σ s², seconds) per timed row; barriers keep the ranks in step."""
    model.run(rows[:1], rows[0].num_tokens, f"fit {model.kind.name}")  # warm-up, untimed
    out = []
    for _ in range(repeats):
        for mb in rows:
            dist.barrier()
            out.extend(model.run([mb], mb.num_tokens, f"fit {model.kind.name}").mb_times_s)
    return out


def fit_kind(kind: ReplicaKind, samples: Sequence[tuple[int, int, float]], min_r2: float) -> SeqCost:
    return fit_seq_cost([s[0] for s in samples], [s[2] for s in samples], sq_lengths=[s[1] for s in samples],
                        min_r2=min_r2, field=f"system.real.kinds[{kind.name}] cost fit")
