"""Knobs only real mode reads (``system.real.*``; the CPU experiment, README "Real mode").

Replica kinds are the CPU stand-ins for strategies that differ in speed and memory: the CPU
experiment's A = activation checkpointing with a 2048-token micro-batch cap, B = no checkpointing with a
1024-token cap (the cap is a memory limit: a micro-batch above it is an error, never clipped),
and optionally a ``tp: 2`` kind spanning both ranks. A real candidate is a list of kind names
whose ``tp`` sum to the rank count; a run is one batching rule over a candidate pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

BATCHING = ("greedy", "two_stage")


@dataclass
class ReplicaKind:
    name: str = "A"
    checkpoint: bool = True  # activation checkpointing (recompute in backward): slower, less memory
    cap: int = 2048  # tokens per micro-batch (the CPU stand-in for maxlen_k)
    tp: int = 1  # ranks of one replica (1, or every rank: explicit TP over the world)
    util: int = 128  # util_tp stand-in: fewest tokens per micro-batch worth running (caps v)


def _spec5_kinds() -> List[ReplicaKind]:
    return [ReplicaKind("A", True, 2048, 1), ReplicaKind("B", False, 1024, 1)]


@dataclass
class RealRun:
    """One interleaved run: ``greedy`` = B0 (greedy packing to the first replica's cap, equal
    micro-batch count per replica, one candidate), ``two_stage`` = dispatch + ILP packing over
    the pool (:func:`impl.hydraulis.step_plan.plan_step`)."""

    name: str = "H"
    batching: str = "two_stage"
    candidates: List[List[str]] = field(default_factory=lambda: [["A", "B"]])


@dataclass
class HydraulisRealKnobs:
    kinds: List[ReplicaKind] = field(default_factory=_spec5_kinds)
    # The runs of one job, interleaved (one step each per round on the same batch, the order
    # rotating every round); the first is the system's own (its ``step_time_s``), the others
    # give ``speedup_vs_<name>`` = their median step / the first's. Empty = the policy's own
    # run alone (its component in impl.hydraulis.policies).
    runs: List[RealRun] = field(default_factory=list)
    # Fit (a, b, c) per kind from timed micro-batches before the measured steps: single
    # sequences of these lengths (those above the kind's cap are skipped) and packed rows of
    # ``pack_rows`` (count x length), each timed ``fit_repeats`` times after one untimed pass.
    fit_lengths: List[int] = field(default_factory=lambda: [64, 128, 256, 512, 768, 1024, 1536, 2048])
    pack_rows: List[List[int]] = field(default_factory=lambda: [[8, 64], [4, 128], [8, 128], [4, 256], [2, 512],
                                                                 [4, 512]])
    fit_repeats: int = 2
    fit_min_r2: float = 0.9
    # Plan step t+1 in a thread of rank 0 while step t runs (False: plan inline, untimed).
    plan_ahead: bool = True
    # Check the first ``check_steps`` steps of every run (0 = every step, -1 = none) against a
    # single-process model on the same batch: loss, every gradient, parameters after Adam.
    check_steps: int = 1
    grad_rtol: float = 1e-5
    timeout_s: float = 1800.0
