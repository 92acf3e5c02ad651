"""One real run's plan of one step, as plain data (rank 0 plans, every rank executes).

- ``greedy`` (B0, README "Real mode"): greedy packing (as the authors' batching modes 2/3) to the smallest cap of the run's one
  candidate, micro-batch i to replica ``i mod R`` (equal micro-batch counts, a short replica
  padded with nothing: Megatron's DP split of packed samples).
- ``two_stage`` (B1, H): :func:`impl.hydraulis.step_plan.plan_step` over the run's pool with the
  fitted :class:`~impl.hydraulis.cost.strategy.ReplicaCost` of each kind (dispatch, then ILP packing).
Either way the micro-batches run largest-first (as in the authors' planner) and the plan carries the cost
model's prediction of every replica's compute time (:meth:`ReplicaCost.replica_time`), so the
record compares it with the measured time. :class:`PlanAhead` runs the planner in a thread of
rank 0 while the previous step trains ([R], README "Real mode").
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from impl.common.api import ConfigError
from impl.common.varlen.packing import MicroBatch, assign_dp, greedy_pack, largest_first

from impl.hydraulis.cost.strategy import ReplicaCost
from impl.hydraulis.dispatch import DEFAULT_BUDGET
from impl.hydraulis.real.config import BATCHING, RealRun
from impl.hydraulis.step_plan import plan_step


@dataclass(frozen=True)
class RunPlan:
    run: str
    round: int
    candidate: int
    kinds: tuple[str, ...]  # replica kinds, in rank order
    micro_batches: tuple[tuple[MicroBatch, ...], ...]  # per replica, largest first
    replica_ms: tuple[float, ...]  # predicted compute per replica
    plan_s: float
    status: str  # ILP statuses of the chosen candidate ("" for greedy)

    @property
    def predicted_ms(self) -> float:
        return max(self.replica_ms)

    @property
    def active(self) -> tuple[bool, ...]:
        return tuple(bool(m) for m in self.micro_batches)

    def summary(self) -> dict:
        return {"candidate": self.candidate, "kinds": list(self.kinds), "predicted_ms": self.predicted_ms,
                "replica_ms": list(self.replica_ms), "plan_s": self.plan_s, "status": self.status,
                "num_micro_batches": [len(m) for m in self.micro_batches],
                "tokens": [sum(mb.num_tokens for mb in m) for m in self.micro_batches]}


def _mbs(ids: np.ndarray, lengths: np.ndarray, groups: Sequence[Sequence[int]], cap: int) -> tuple[MicroBatch, ...]:
    out = [MicroBatch(tuple(int(ids[i]) for i in g), tuple(int(lengths[i]) for i in g),
                      int(sum(int(lengths[i]) for i in g)), cap) for g in groups if len(g)]
    return tuple(largest_first(out))


class Planner:
    def __init__(self, costs: Mapping[str, ReplicaCost], *, shuffles: int, v_window: int, time_limit_s: float,
                 seed: int, mip_rel_gap: float = 0.0, includes_c: bool = True, refine: bool = True,
                 budget: int = DEFAULT_BUDGET) -> None:
        self.costs, self.seed = dict(costs), seed
        self.opts = {"shuffles": shuffles, "v_window": v_window, "time_limit_s": time_limit_s,
                     "mip_rel_gap": mip_rel_gap, "includes_c": includes_c, "refine": refine, "budget": budget}

    def plan(self, run: RealRun, rnd: int, ids: np.ndarray, lengths: np.ndarray) -> RunPlan:
        t0 = time.perf_counter()
        if run.batching == "greedy":
            kinds = tuple(run.candidates[0])
            costs = [self.costs[k] for k in kinds]
            cap = min(c.cap for c in costs)
            packed = greedy_pack(ids, lengths, cap, pad="none", field=f"system.real.runs[{run.name}]")
            per = assign_dp(packed, len(kinds), field=f"system.real.runs[{run.name}]")
            mbs = tuple(tuple(largest_first([mb for mb in r if not mb.is_empty])) for r in per)
            cand, status = 0, ""
        else:
            pool = [[self.costs[k] for k in cand] for cand in run.candidates]
            sp = plan_step(lengths, pool, seed=self.seed + rnd, **self.opts)
            cand, kinds = sp.candidate, tuple(run.candidates[sp.candidate])
            for j, (rp, k) in enumerate(zip(sp.replicas, kinds)):  # the candidate's order = rank order
                if rp.replica != self.costs[k]:
                    raise ValueError(f"run {run.name}: planned replica {j} is {rp.replica}, candidate has {k!r}")
            slots = sp.replicas
            mbs = tuple(_mbs(ids, lengths, s.micro_batches, self.costs[k].cap) for s, k in zip(slots, kinds))
            status = ",".join(f"{k}:{v}" for k, v in sorted(sp.statuses.items()))
        ms = tuple(self.costs[k].replica_time([mb.lengths for mb in m]) for k, m in zip(kinds, mbs))
        got = sorted(int(i) for m in mbs for mb in m for i in mb.seq_ids)
        if got != sorted(int(i) for i in ids):
            raise ValueError(f"run {run.name} round {rnd}: the plan holds {len(got)} of {len(ids)} sequences")
        return RunPlan(run.name, rnd, cand, kinds, mbs, ms, time.perf_counter() - t0, status)


class PlanAhead:
    """Plans in one background thread (rank 0): ``submit`` for step t+1 while step t runs,
    ``get`` returns the plan and how long the caller waited for it."""

    def __init__(self, planner: Planner, ahead: bool) -> None:
        self.planner, self.ahead = planner, ahead
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hydraulis-plan") if ahead else None
        self.futures: dict[tuple[str, int], Future] = {}

    def submit(self, run: RealRun, rnd: int, ids, lengths) -> None:
        if self.pool is not None:
            self.futures[(run.name, rnd)] = self.pool.submit(self.planner.plan, run, rnd, ids, lengths)

    def get(self, run: RealRun, rnd: int, ids, lengths) -> tuple[RunPlan, float]:
        t0 = time.perf_counter()
        fut = self.futures.pop((run.name, rnd), None)
        plan = fut.result() if fut is not None else self.planner.plan(run, rnd, ids, lengths)
        return plan, (time.perf_counter() - t0 if self.ahead else 0.0)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def check_run(run: RealRun, kinds: Mapping[str, "object"], world: int, context: int, field: str) -> None:
    if run.batching not in BATCHING:
        raise ConfigError(f"{field}.batching: unknown {run.batching!r} (one of: {', '.join(BATCHING)})")
    if not run.candidates:
        raise ConfigError(f"{field}.candidates: a run needs at least one candidate")
    if run.batching == "greedy" and len(run.candidates) != 1:
        raise ConfigError(f"{field}.candidates: greedy batching runs one fixed candidate, got {len(run.candidates)}")
    fits = []
    for c, cand in enumerate(run.candidates):
        for k in cand:
            if k not in kinds:
                raise ConfigError(f"{field}.candidates[{c}]: unknown replica kind {k!r} (known: {', '.join(kinds)})")
        tps = sum(kinds[k].tp for k in cand)
        if not cand or tps != world:
            raise ConfigError(f"{field}.candidates[{c}]: replicas {list(cand)} span {tps} ranks, "
                              f"workload.num_gpus is {world} (sum of tp must equal it)")
        caps = [kinds[k].cap for k in cand]
        fits.append(min(caps) if run.batching == "greedy" else max(caps))
    if max(fits) < context:
        raise ConfigError(f"{field}.candidates: no candidate holds a sequence of workload.context {context} tokens "
                          f"(largest {'smallest-replica ' if run.batching == 'greedy' else ''}cap {max(fits)})")
