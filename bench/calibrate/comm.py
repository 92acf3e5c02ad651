"""Point-to-point and all-reduce timings between ranks over gloo (``system=harness/calibrate``).

Ping-pong between ranks 0 and 1 (one-way time = round trip / 2) and ``all_reduce`` (sum)
over every rank, through :func:`impl.common.runtime.launch.launch`: local processes bound to
loopback by default; under torchrun the ranks of the job (then ranks 0 and 1 may sit on
different hosts, and the figures are that network's).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from impl.common.runtime.launch import RankContext, launch
from impl.common.execution import set_torch_threads


def _comm_worker(ctx: RankContext, p2p_sizes: List[int], ar_sizes: List[int], warmup: int, repeats: int,
                 min_repeats: int, budget_s: float) -> Optional[dict]:
    """One rank. Rank 0 returns ``{"p2p": {size: [one-way s]}, "allreduce": {size: [s]}}``."""
    rank = ctx.rank
    set_torch_threads(1)
    if True:
        p2p: Dict[int, List[float]] = {}
        if rank < 2:  # untimed rounds: the first messages pay for connection setup
            warm = torch.zeros(8, dtype=torch.uint8)
            for _ in range(max(3, warmup)):
                if rank == 0:
                    dist.send(warm, dst=1)
                    dist.recv(warm, src=1)
                else:
                    dist.recv(warm, src=0)
                    dist.send(warm, dst=0)
        for size in p2p_sizes:
            buf = torch.zeros(size, dtype=torch.uint8)
            dist.barrier()
            if rank > 1:
                p2p[size] = []
                continue

            def round_trip() -> float:
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, dst=1)
                    dist.recv(buf, src=1)
                else:
                    dist.recv(buf, src=0)
                    dist.send(buf, dst=0)
                return time.perf_counter() - t0

            # Warm-up rounds double as an estimate; rank 0 turns the time budget into a round
            # count and sends it once, so nothing but the ping-pong runs inside the timed loop.
            est = [round_trip() for _ in range(max(1, warmup))]
            count = torch.zeros(1, dtype=torch.int64)
            if rank == 0:
                per_round = max(statistics.median(est), 1e-9)
                count[0] = max(min_repeats, min(repeats, int(budget_s / per_round)))
                dist.send(count, dst=1)
            else:
                dist.recv(count, src=0)
            round_trip()  # untimed: absorbs the wake-up after the count message
            samples = [round_trip() / 2.0 for _ in range(int(count[0]))]
            p2p[size] = samples
        allreduce: Dict[int, List[float]] = {}
        for size in ar_sizes:
            # float32 elements: the reduction does arithmetic; round the count up.
            buf = torch.zeros(max(1, math.ceil(size / 4)), dtype=torch.float32)
            samples = []
            for i in range(warmup + repeats):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                dt = time.perf_counter() - t0
                if i >= warmup:
                    samples.append(dt)
            allreduce[size] = samples
        dist.barrier()
        return {"p2p": p2p, "allreduce": allreduce} if rank == 0 else None


def measure_comm(cfg) -> Dict[str, Dict[int, List[float]]]:
    """Run ``cfg.comm_procs`` ranks (a :class:`~bench.calibrate.system.CalibrateConfig`) and
    return rank 0's samples (seconds). Rendezvous and every collective time out after
    ``cfg.comm_timeout_s``; the whole measurement after twice that."""
    run = launch(_comm_worker, cfg.comm_procs,
                 (list(cfg.p2p_sizes_bytes), list(cfg.allreduce_sizes_bytes), cfg.warmup, cfg.repeats,
                  cfg.min_repeats, cfg.max_seconds_per_measurement),
                 label="calibrate: gloo", backend="gloo", pg_timeout_s=cfg.comm_timeout_s,
                 timeout_s=2.0 * cfg.comm_timeout_s)
    raw = run.results[0]
    return {k: {int(size): v for size, v in d.items()} for k, d in raw.items()}
