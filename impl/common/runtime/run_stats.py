"""What a real pipeline run measured (:class:`RunStats`), assembled from the ranks' reports."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Mapping

import torch

from impl.common.models.tiny_gpt import params_digest
from impl.common.runtime.link_delay import Link


@dataclass
class RunStats:
    """What a real pipeline run measured. Times in seconds; iteration lists exclude warm-up
    unless named ``all_``."""

    iteration_times_s: list[float]
    warmup_times_s: list[float]
    losses: list[list[float]]  # every iteration (warm-up first), per micro-batch
    params_digest: str  # sha256 of the final parameters (names + bytes)
    params: dict[str, torch.Tensor]  # final parameters by full-model name (CPU)
    last_grads: dict[str, torch.Tensor]  # accumulated gradients of the last iteration
    raw_compute_s: dict[int, dict[str, float]]  # rank -> op -> total raw compute (measured iters)
    padded_compute_s: dict[int, dict[str, float]]  # rank -> op -> total incl. padding sleep
    op_counts: dict[int, dict[str, int]]  # rank -> op -> count (measured iterations)
    messages: list[dict[str, int]]  # per iteration: "0->1 fwd" -> messages (both ends agreed)
    send_wait_s: dict[int, float]  # rank -> compute-thread time inside send() (measured iters)
    peak_in_flight: dict[int, int]  # rank -> most activations held at once
    detection: str  # 'oracle' or 'measured'
    injected_delays_s: list[dict[str, float]]  # per iteration, "0-1" -> seconds
    scheduler_delays_s: list[dict[str, float]]  # per iteration, what schedule_fn was given
    estimated_delays_s: list[dict[str, float]]  # per iteration end, the detector's estimate
    min_transit_s: list[dict[str, float]]  # per iteration, per link minimum message transit
    comm_paths: list[str]  # per iteration: inline | fifo | delegated
    schedules: list[str]  # distinct schedules run, in order (text form)
    schedule_index: list[int]  # per iteration, index into ``schedules``
    comm: str
    num_delegates: int
    backend: str
    device: str
    start_method: str
    op_pad_s: float
    setup_s: dict[int, float] = field(default_factory=dict)  # rank -> process-group/model setup time
    delegate_messages: dict[str, int] = field(default_factory=dict)  # delegate -> messages handled
    child_pids: list[int] = field(default_factory=list)  # every process started (all gone now)

    def summary(self) -> dict:
        """JSON-able view (no tensors) for records and logs."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("params", "last_grads")}
        out["median_iteration_time_s"] = self.median_iteration_time_s
        out["mean_raw_op_s"] = {op: self.mean_raw_op_s(op) for op in ("F", "B", "W", "BW") if self.mean_raw_op_s(op)}
        return json.loads(json.dumps(out, default=str))

    @property
    def median_iteration_time_s(self) -> float:
        return statistics.median(self.iteration_times_s)

    def mean_raw_op_s(self, op: str) -> float:
        tot = sum(r.get(op, 0.0) for r in self.raw_compute_s.values())
        cnt = sum(c.get(op, 0) for c in self.op_counts.values())
        return tot / cnt if cnt else 0.0


def link_key(link: Link) -> str:
    return f"{link[0]}-{link[1]}"


def keyed(table: Mapping[Link, float]) -> dict[str, float]:
    return {link_key(k): float(v) for k, v in sorted(table.items())}


def collect(results: list[dict], cfg, K: int, backend: str, device: str, pids: list,
            start_method: str, delegate_counts: Mapping[str, int]) -> RunStats:
    """Merge the ranks' reports (``cfg``: the run's TrainerConfig); both ends of every link
    must have counted the same messages."""
    S, warm = cfg.num_stages, cfg.warmup
    r0 = results[0]
    last = results[S - 1]
    params: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for r in range(S):
        params.update(results[r]["params"])
        grads.update(results[r]["last_grads"])
    messages = []
    for it in range(warm + cfg.iterations):
        merged: dict[str, int] = {}
        for r in range(S):
            for k, v in results[r]["messages"][it].items():
                if merged.setdefault(k, v) != v:
                    raise RuntimeError(f"iteration {it}: {k} counted {merged[k]} by one end and {v} by the other")
        messages.append(merged)
    paths = r0["paths"]
    return RunStats(
        iteration_times_s=r0["times"][warm:], warmup_times_s=r0["times"][:warm], losses=last["losses"],
        params_digest=params_digest(params), params=params, last_grads=grads,
        raw_compute_s={r: results[r]["stats"]["raw"] for r in range(S)},
        padded_compute_s={r: results[r]["stats"]["padded"] for r in range(S)},
        op_counts={r: results[r]["stats"]["count"] for r in range(S)},
        messages=messages, send_wait_s={r: results[r]["send_wait"] for r in range(S)},
        peak_in_flight={r: results[r]["peak"] for r in range(S)}, detection=cfg.controller.detection,
        injected_delays_s=r0["injected"], scheduler_delays_s=r0["sched_delays"],
        estimated_delays_s=r0["estimates"], min_transit_s=r0["transit"], comm_paths=paths,
        schedules=r0["schedules"], schedule_index=r0["schedule_index"], comm=cfg.comm, num_delegates=K,
        backend=backend, device=device, start_method=start_method,
        op_pad_s=cfg.op_pad_s, setup_s={r: results[r]["setup_s"] for r in range(S)},
        delegate_messages=dict(delegate_counts), child_pids=pids)
