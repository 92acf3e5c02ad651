"""Save, load and recovery costs per system and storage profile ([R]: impl/ckpt_recovery/README.md, "Sim").

Save (per checkpoint): ``staging`` = a rank's state / D2H bandwidth; ``write`` = the writers'
bytes through the store (its bandwidth shared by rank, node or the whole job, times the copies
a node-local store keeps) + requests x latency; ``commit`` = the commit's requests.
- overlapped (ours, the RAM tier of Gemini-like): stall = max(0, staging - step), the copy runs
  on a side stream under the next step; the save commits staging + write + commit later.
- staged (DCP async): stall = staging; commits write + commit later.
- sync (DCP sync, restart_all, UCP-like's DeepSpeed save): stall = staging + write + commit.
Interval: Young/Daly I* = sqrt(2 C MTBF) with C the system's own stall, no shorter than its
commit lag (skip-not-wait) or ``min_interval_s``. Expected rework after a failure at a uniform
phase = I/2 + commit lag (a failure during an in-flight save falls back one interval);
``mid_save``: I + lag/2. With local copies (sim/local.py) the lag runs until the copies are
written, and recovery counts from the last copied save.
Load: the slowest reader's requests x latency + its bytes at its bandwidth share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from impl.common.parallel.plan import Plan
from impl.common.storage.emulator import StorageProfile

from impl.ckpt_recovery.sim.checkpoint_io import LoadIO, SaveIO


def young_daly_s(stall_s: float, mtbf_s: float) -> float:
    """I* = sqrt(2 C MTBF) (Young 1974; Daly 2006's first-order term)."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def _rank_nodes(plan: Plan) -> dict[int, int]:
    return {e["rank"]: e["node"] for e in plan.rank_map()}


def write_time_s(prof: StorageProfile, io: SaveIO, plan: Plan) -> float:
    """Every writer at once; node-local stores write ``write_copies`` copies."""
    if not io.rank_bytes:
        return 0.0
    copies = prof.write_copies
    lat = max(io.rank_calls.values()) * prof.latency_s
    bw = prof.bandwidth_bytes_per_s
    if not bw:
        return lat
    if prof.scope == "aggregate":
        return lat + copies * sum(io.rank_bytes.values()) / bw
    if prof.scope == "node":
        nodes = _rank_nodes(plan)
        per: dict[int, float] = {}
        for r, b in io.rank_bytes.items():
            per[nodes[r]] = per.get(nodes[r], 0.0) + b
        return lat + copies * max(per.values()) / bw
    return max(copies * b / bw + io.rank_calls[r] * prof.latency_s for r, b in io.rank_bytes.items())


def read_time_s(prof: StorageProfile, io: LoadIO, plan: Plan) -> float:
    """Every reader at once; the slowest one's requests and its bandwidth share."""
    bw = prof.bandwidth_bytes_per_s
    lat = max(r.calls for r, _ in io.readers) * prof.latency_s
    if not bw:
        return lat
    if prof.scope == "aggregate":
        return lat + io.total_bytes() / bw
    per_node = max(_per_node_counts(plan).values())
    share = per_node if prof.scope == "node" else 1
    return max(r.calls * prof.latency_s + r.nbytes * share / bw for r, _ in io.readers)


def _per_node_counts(plan: Plan) -> Mapping[int, int]:
    out: dict[int, int] = {}
    for g in plan.active_gpus:
        out[g // plan.gpus_per_node] = out.get(g // plan.gpus_per_node, 0) + 1
    return out


@dataclass(frozen=True)
class SaveCost:
    stall_s: float  # training blocked per checkpoint
    lag_s: float  # snapshot -> committed (0 for sync saves: committed when the stall ends)
    interval_s: float

    @property
    def overhead(self) -> float:
        """Share of wall time lost to checkpoint stalls."""
        return self.stall_s / (self.interval_s + self.stall_s)

    def rework_s(self, mid_save: bool = False) -> float:
        if mid_save:
            return self.interval_s + self.lag_s / 2.0
        return self.interval_s / 2.0 + self.lag_s


def save_cost(mode: str, staging_s: float, write_s: float, commit_s: float, step_s: float, mtbf_s: float,
              min_interval_s: float, fixed_interval_s: float = 0.0, after_commit_s: float = 0.0) -> SaveCost:
    """``after_commit_s``: background work after the commit a save must finish before the next
    one starts and before it counts for recovery (the local copies, sim/local.py); part of the lag."""
    if mode == "overlapped":
        stall, lag = max(0.0, staging_s - step_s), staging_s + write_s + commit_s
    elif mode == "staged":
        stall, lag = staging_s, write_s + commit_s
    elif mode == "sync":
        stall, lag = staging_s + write_s + commit_s, 0.0
    else:
        raise ValueError(mode)
    lag += after_commit_s
    if fixed_interval_s:
        interval = max(fixed_interval_s, lag)
    else:
        interval = max(young_daly_s(stall, mtbf_s), lag, min_interval_s, step_s)
    return SaveCost(stall, lag, interval)
