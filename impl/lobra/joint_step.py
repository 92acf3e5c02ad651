"""One joint step, as data (shared by sim and real mode): sample every task's batch, bucket the
lengths, dispatch bucket counts over the deployment, split into each replica's micro-batches.

Sequence ids are unique per task (a per-task seeded stream), so a :class:`Sample` is
``(task, id, length)`` and every rank rebuilds the same step from the seed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

from impl.common.api import ConfigError
from impl.common.llm.lora_train import Sample
from impl.common.varlen.sampling import LengthStream

from impl.lobra import bucketing
from impl.lobra.dispatch import BucketDispatch, ReplicaGroup, dispatch, micro_batches, split_samples

class Bucketing(enum.StrEnum):
    """Length buckets per step: chosen for the step's lengths (dynamic) or the fixed list."""

    dynamic = "dynamic"
    fixed = "fixed"


class BucketCuts(enum.StrEnum):
    """Dynamic buckets cut at the deployed replicas' max_tokens: on, off, or whichever dispatches faster (auto)."""

    auto = "auto"
    on = "on"
    off = "off"


BUCKETINGS, BUCKET_CUTS = tuple(Bucketing), tuple(BucketCuts)


class TaskStreams:
    """One seeded length stream per task; :meth:`step` draws every task's batch."""

    def __init__(self, tasks, seed: int) -> None:
        self.tasks = list(tasks)
        self.streams = [LengthStream(t.lengths, seed * 1000 + i) for i, t in enumerate(self.tasks)]

    def step(self) -> list[Sample]:
        out = []
        for t, st in zip(self.tasks, self.streams):
            b = st.by_count(t.batch_seqs)
            out += [Sample(t.name, int(i), int(n)) for i, n in zip(b.ids, b.lengths)]
        return out


@dataclass
class JointStepPlan:
    boundaries: list[int]
    dispatch: BucketDispatch
    # replicas[j][k]: [(bucket length, [Sample, ...]), ...] of replica k of group j
    replicas: list[list[list[tuple[int, list]]]]
    real_tokens: int
    padded_tokens: int
    info: dict = field(default_factory=dict)

    @property
    def pad_ratio(self) -> float:
        return (self.padded_tokens - self.real_tokens) / self.padded_tokens


def boundaries_for(samples: Sequence[Sample], kind: str, *, num_buckets: int, fixed: Sequence[int],
                   align: int = 16, min_len: int = 0, cuts: Sequence[int] = ()) -> list[int]:
    """The step's bucket boundaries; dynamic buckets never straddle a value of ``cuts``."""
    if kind == "dynamic":
        return bucketing.dynamic_buckets([s.length for s in samples], num_buckets, align, min_len, cuts=cuts)
    if kind == "fixed":
        top = max(s.length for s in samples)
        bs = sorted(int(b) for b in fixed)
        if top > bs[-1]:
            raise ConfigError(f"system.fixed_buckets: longest sequence {top} is above the largest bucket {bs[-1]}")
        return bs
    raise ConfigError(f"system.bucketing: unknown {kind!r} (one of: {', '.join(BUCKETINGS)})")


def plan_step(groups: Sequence[ReplicaGroup], samples: Sequence[Sample], boundaries: Sequence[int], dispatcher: str, *,
              exec_mode: str = "fused", min_len: int = 0, task_order: Sequence[str] = (), **solver) -> JointStepPlan:
    if not samples:
        raise ConfigError("workload.tasks: the step has no sequences")
    bs = sorted(int(b) for b in boundaries)
    of = dict(zip(((s.task, s.seq_id) for s in samples), bucketing.assign([s.length for s in samples], bs)))
    order = {t: k for k, t in enumerate(task_order or dict.fromkeys(s.task for s in samples))}
    by_bucket = {b: [] for b in bs}
    for s in samples:
        by_bucket[of[s.task, s.seq_id]].append(s)
    used = [b for b in bs if by_bucket[b]]
    seqs = [sorted(by_bucket[b], key=lambda s: (order[s.task], s.seq_id)) for b in used]
    pad_b = [max(b, min_len) for b in used]
    d = dispatch(dispatcher, groups, pad_b, [len(x) for x in seqs], **solver)
    split = split_samples(seqs, groups, d)
    bucket_of = {(s.task, s.seq_id): max(of[s.task, s.seq_id], min_len) for s in samples}
    replicas = [[micro_batches(r, lambda x: bucket_of[x.task, x.seq_id], g.scheme, exec_mode) for r in split[j]]
                for j, g in enumerate(groups)]
    real = sum(s.length for s in samples)
    padded = sum(bucket_of[s.task, s.seq_id] for s in samples)
    return JointStepPlan(bs, d, replicas, real, padded)


def plan_bucketed(groups: Sequence[ReplicaGroup], samples: Sequence[Sample], kind: str, dispatcher: str, *,
                  num_buckets: int, fixed: Sequence[int], cuts: str = "auto", min_len: int = 0,
                  exec_mode: str = "fused", task_order: Sequence[str] = (), **solver) -> JointStepPlan:
    """Bucket one step (:func:`boundaries_for`) and plan it (:func:`plan_step`).

    ``cuts`` (dynamic buckets only): ``on`` keeps every bucket on one side of each deployed
    replica's max_tokens, so the sequences that fit a smaller replica can be dispatched to it; a
    cut spends one of the B buckets, so it can cost padding elsewhere. ``off`` is the plain DP.
    ``auto`` plans both and keeps the lower planned makespan (``dispatch.objective_s``)."""
    if cuts not in BUCKET_CUTS:
        raise ConfigError(f"system.bucket_cuts: unknown {cuts!r} (one of: {', '.join(BUCKET_CUTS)})")
    maxes = sorted({g.scheme.max_tokens for g in groups})
    variants = [()] if kind != "dynamic" or cuts == "off" or len(maxes) < 2 else \
        [maxes] if cuts == "on" else [(), maxes]
    best, seen = None, []
    for cut in variants:
        try:
            bs = boundaries_for(samples, kind, num_buckets=num_buckets, fixed=fixed, min_len=min_len, cuts=cut)
        except ConfigError:
            if cuts == "on" or not cut:
                raise
            continue  # auto: too few buckets for the cuts, keep the plain DP
        if bs in seen:
            continue  # the plain DP already respects the cuts: same plan
        seen.append(bs)
        sp = plan_step(groups, samples, bs, dispatcher, exec_mode=exec_mode, min_len=min_len, task_order=task_order,
                       **solver)
        sp.info["bucket_cuts"] = list(cut)
        if best is None or sp.dispatch.objective_s < best.dispatch.objective_s - 1e-12:
            if best is not None:
                sp.dispatch.solve_s += best.dispatch.solve_s
            best = sp
        else:
            best.dispatch.solve_s += sp.dispatch.solve_s
    return best
