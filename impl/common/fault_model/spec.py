"""Typed fault specs. Each fault yaml names its ``kind``; validation picks the dataclass."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class NoFault:
    kind: str = "none"


@dataclass
class DelayEvent:
    """One segment of a time-varying delay trace: from ``start_iter`` (inclusive) on."""

    start_iter: int = 0
    links: List[List[int]] = field(default_factory=list)
    delay_s: float = 0.0


@dataclass
class LinkDelay:
    """Extra per-message latency on pipeline links (i, i+1)."""

    kind: str = "link_delay"
    links: List[List[int]] = field(default_factory=lambda: [[0, 1]])
    delay_s: float = 0.0
    start_iter: int = 0
    stop_iter: Optional[int] = None
    # Optional time-varying trace; when non-empty it replaces links/delay_s.
    trace: List[DelayEvent] = field(default_factory=list)
    # 'oracle': the scheduler is told the delays; 'measured': per-link timers + change detection.
    detection: str = "oracle"
    # Iterations before which an RNIC of the pipeline fails (ADAPTRA's 140B trace, sim only):
    # host-delegated systems fail over to another NIC for free, the others pay a
    # checkpoint-restart (system.restart_cost_s).
    rnic_failure_iters: List[int] = field(default_factory=list)


@dataclass
class DpLinkDelay:
    """Extra per-message latency on one data-parallel link: the link between two replicas of
    pipeline stage ``stage``, which that stage's gradient ring all-reduce crosses (ADAPTRA's
    sim scenario S5, sim only). Negative ``stage`` counts from the last stage."""

    kind: str = "dp_link_delay"
    stage: int = 0
    delay_s: float = 0.0
    start_iter: int = 0
    stop_iter: Optional[int] = None
    # 'oracle': mitigating systems are told at once; 'measured': change-point detection on
    # iteration times (Falcon's detector, which ADAPTRA reuses).
    detection: str = "oracle"


@dataclass
class VaryingLinkDelay:
    """Pipeline-link delays that change inside iterations (ADAPTRA's sim scenario S6, sim only).

    From time 0, every U(interval_s) seconds ``links_per_change`` links (0 = all) drawn from ``links``
    ([] = every pipeline link) get a delay drawn from ``delay_s`` = [low, high] in steps of
    ``delay_step_s`` (0 = continuous); the other links carry none. Deterministic per ``seed``.
    """

    kind: str = "varying_link_delay"
    links: List[List[int]] = field(default_factory=list)
    links_per_change: int = 0
    interval_s: List[float] = field(default_factory=lambda: [0.05, 0.10])
    delay_s: List[float] = field(default_factory=lambda: [0.010, 0.060])
    delay_step_s: float = 0.001
    seed: int = 0
    # 'oracle': the scheduler sees the delays in force when an iteration starts; 'measured':
    # each link's time-averaged delay over the previous iteration.
    detection: str = "oracle"


@dataclass
class SlowdownEvent:
    """One segment of a compute-slowdown trace: from ``start_iter`` (inclusive) on, ``gpus``
    run ``factor`` (or ``factors[k]`` for ``gpus[k]``) times slower; the others run at 1."""

    start_iter: int = 0
    gpus: List[int] = field(default_factory=list)
    factor: float = 1.0
    factors: List[float] = field(default_factory=list)


@dataclass
class ComputeSlowdown:
    """GPUs whose compute runs ``factor`` times slower (Malleus's straggling rate x_g)."""

    kind: str = "compute_slowdown"
    gpus: List[int] = field(default_factory=list)
    factor: float = 1.0
    start_iter: int = 0
    stop_iter: Optional[int] = None
    # Per-GPU factors (same length as gpus); empty = ``factor`` for all of them.
    factors: List[float] = field(default_factory=list)
    # Optional time-varying trace; when non-empty it replaces gpus/factor(s).
    trace: List[SlowdownEvent] = field(default_factory=list)
    # Scales every injected factor's excess over nominal, x -> 1 + severity (x - 1): one knob
    # over scenarios whose rates differ (a hinge experiment sweeps how much a claim follows them);
    # 1 = the rates as written, 0 = no straggler.
    severity: float = 1.0


@dataclass
class RankKill:
    """Kill a worker at an iteration (the job must record the failure, not hang)."""

    kind: str = "rank_kill"
    rank: int = 0
    at_iter: int = 0


@dataclass
class GpuLoss:
    """GPUs (global ids = ranks of the nominal layout) die at a step (checkpoint recovery,
    real and sim). ``mid_save``: the loss lands while a checkpoint save is in flight (real: during
    the write; sim: the in-flight save never commits). ``seed`` (with the job seed) draws what is
    left open: real mode reads ``ranks: []`` as a seeded rank of the last stage and
    ``at_step < 0`` as a seeded step; the kill lands at that step's boundary."""

    kind: str = "gpu_loss"
    ranks: List[int] = field(default_factory=lambda: [0])
    at_step: int = 0
    mid_save: bool = False
    seed: int = 0


@dataclass
class NodeLoss:
    """Every GPU of node ``node`` dies at a step (fields as :class:`GpuLoss`)."""

    kind: str = "node_loss"
    node: int = 0
    at_step: int = 0
    mid_save: bool = False
    seed: int = 0


KINDS = {
    "none": NoFault,
    "link_delay": LinkDelay,
    "dp_link_delay": DpLinkDelay,
    "varying_link_delay": VaryingLinkDelay,
    "compute_slowdown": ComputeSlowdown,
    "rank_kill": RankKill,
    "gpu_loss": GpuLoss,
    "node_loss": NodeLoss,
}
