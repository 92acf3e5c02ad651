"""Serving metrics shared by the real engine and the simulator (CaraServe's metrics,
arXiv 2401.11240)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from impl.common.api import Metric


@dataclass
class RequestRecord:
    rid: int
    adapter: str
    rank: int
    arrival_s: float
    first_token_s: float
    done_s: float
    output_len: int
    cold: bool = False
    interruptions: int = 0
    slo_tpot_s: float = math.inf
    server: int = 0
    isolated_s: float = 0.0  # isolated service time (sim invariant: latency >= this)
    # Time this request sat stalled by any adapter load (its own, and others' that paused its
    # decode), and how many loads did so (sim; as CaraServe's paper counts it, v1 Fig. 3-left).
    stall_s: float = 0.0
    load_stalls: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        return (self.done_s - self.first_token_s) / (self.output_len - 1) if self.output_len > 1 else 0.0

    @property
    def latency_s(self) -> float:
        return self.done_s - self.arrival_s


def _stats(name: str, vals: Sequence[float], unit: str = "s") -> dict[str, Metric]:
    a = np.asarray(vals, dtype=float)
    if not len(a):
        return {}
    return {f"{name}_mean_{unit}": Metric(value=float(a.mean()), unit=unit, better="lower", n=len(a),
                                          p50=float(np.percentile(a, 50)), p10=float(np.percentile(a, 10)),
                                          p90=float(np.percentile(a, 90))),
            f"{name}_p50_{unit}": Metric.scalar(float(np.percentile(a, 50)), unit),
            f"{name}_p99_{unit}": Metric.scalar(float(np.percentile(a, 99)), unit)}


def serving_metrics(records: Sequence[RequestRecord], arrived: int, dropped: int, makespan_s: float,
                    stall_s: float, busy_s: float, request_stalls: bool = False) -> dict[str, Metric]:
    """``stall_share``: with ``request_stalls`` (sim) the paper's count (v1 Fig. 3-left), the stall time
    every request sat through over the requests' total serving time (arrival to done); without,
    the server's stalled share of its busy time (real engine), which is also always
    ``stall_share_server``."""
    m: dict[str, Metric] = {}
    m.update(_stats("ttft", [r.ttft_s for r in records]))
    m.update(_stats("tpot", [r.tpot_s for r in records if r.output_len > 1]))
    m.update(_stats("latency", [r.latency_s for r in records]))
    n = len(records)
    ok = sum(1 for r in records if r.output_len <= 1 or r.tpot_s <= r.slo_tpot_s)
    tokens = sum(r.output_len for r in records)
    m["slo_attainment"] = Metric.scalar(ok / n if n else 0.0, "fraction", "higher")
    m["throughput_tokens_per_s"] = Metric.scalar(tokens / makespan_s if makespan_s > 0 else 0.0, "tokens/s", "higher")
    m["throughput_requests_per_s"] = Metric.scalar(n / makespan_s if makespan_s > 0 else 0.0, "req/s", "higher")
    m["cold_starts"] = Metric.scalar(sum(1 for r in records if r.cold), "requests", "lower")
    m["interruptions_mean"] = Metric.scalar(float(np.mean([r.interruptions for r in records])) if n else 0.0,
                                            "iterations", "lower")
    server_share = stall_s / busy_s if busy_s > 0 else 0.0
    m["stall_share_server"] = Metric.scalar(server_share, "fraction", "lower")
    if request_stalls:
        served = sum(r.latency_s for r in records)
        m["stall_share"] = Metric.scalar(sum(r.stall_s for r in records) / served if served > 0 else 0.0,
                                         "fraction", "lower")
        m["load_stalls_p50"] = Metric.scalar(float(np.median([r.load_stalls for r in records])) if n else 0.0,
                                             "loads", "lower")
        m["interruptions_p50"] = Metric.scalar(float(np.median([r.interruptions for r in records])) if n else 0.0,
                                               "iterations", "lower")
    else:
        m["stall_share"] = Metric.scalar(server_share, "fraction", "lower")
    m["completed"] = Metric.scalar(n, "requests", "higher")
    m["dropped"] = Metric.scalar(dropped, "requests", "lower")
    m["arrived"] = Metric.scalar(arrived, "requests", "higher")
    return m


def check_conservation(result, arrived: int, completed: int, dropped: int) -> None:
    """completed + dropped = arrived, or the record is invalid."""
    if completed + dropped != arrived:
        result.mark_invalid(f"completed ({completed}) + dropped ({dropped}) != arrived ({arrived})")
