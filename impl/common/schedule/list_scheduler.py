"""Greedy list scheduler: per-stage warm-up quotas -> a compute schedule (B/W split).

ADAPTRA's Alg. 3/4 (arXiv 2504.19232), shared: ADAPTRA runs it on its delay-adapted quotas
(:mod:`impl.adaptra.builder`) and the delay-blind ZB baseline on Alg. 1 quotas with unit op
times (:mod:`impl.common.schedule.generators`). The paper simulates the pipeline in discrete time (step δ) with the profiled op times and the
measured link delays, and records the order in which each stage ends up running its ops;
that order (not the timing) is the schedule. Rules (the paper's Alg. 3/4):

* stage 0 owns every ``F_j`` at time 0; ``F_j`` finishing on stage i at t readies ``F_j`` on
  stage i+1 at ``t + c_i``; on the last stage it readies ``B_j`` there at once; ``B_j``
  finishing on stage i readies ``W_j`` on stage i at once and ``B_j`` on stage i−1 at
  ``t + c_{i−1}``;
* a stage still owing warm-up forwards (fewer than ``x_i`` done) runs only F, idling if none
  is ready; afterwards, among ops ready now, B > F > W, ties by lowest micro-batch id;
* ``wait_first_backward`` (artifact): after warm-up, do not start another F before the first
  B has run;
* ``limit_inflight`` (our harness [R], impl/adaptra/README.md: peak in-flight activations on
  stage i ≤ x_i):
  no F starts while ``x_i`` forwards are waiting for their B. With it on,
  ``wait_first_backward`` changes nothing (the stage is full after warm-up anyway); the paper's
  spill-to-host variant is ``limit_inflight=False``.

Times are converted to whole steps of δ (ops take at least one step), so the result is
exact integer arithmetic. Two drivers share one state machine: ``method="stepped"`` visits
every step (the paper's loop, O(steps·S)), ``method="event"`` jumps to the next completion or
ready-time and only revisits stages something happened to. They give identical schedules
(tested); the event driver builds S=128, N=1024 in about a second.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from impl.common.api import ConfigError
from impl.common.schedule.ir import Action, Op, Schedule
from impl.common.schedule.validate import ScheduleError

_EPS = 1e-9


@dataclass
class Timeline:
    """A built schedule plus the simulated timing that produced it (in steps of ``delta_s``)."""

    schedule: Schedule
    start_step: dict[int, list[int]]  # aligned with schedule[stage]
    end_step: dict[int, list[int]]
    delta_s: float
    max_steps: int  # the termination bound the build was held to

    @property
    def makespan_steps(self) -> int:
        return max((ends[-1] for ends in self.end_step.values() if ends), default=0)

    @property
    def makespan_s(self) -> float:
        return self.makespan_steps * self.delta_s


def _steps(t: float, delta: float, minimum: int) -> int:
    return max(minimum, math.ceil(t / delta - _EPS))


def check_vec(name: str, v: Sequence[float], n: int, *, positive: bool) -> list[float]:
    """``n`` finite numbers (> 0, or >= 0 when not ``positive``), or a one-line ConfigError."""
    try:
        vals = [float(t) for t in v]
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a sequence of numbers, got {v!r}") from None
    if len(vals) != n:
        raise ConfigError(f"{name} has {len(vals)} entries, expected {n}")
    for i, t in enumerate(vals):
        if not (t > 0 if positive else t >= 0) or not math.isfinite(t):
            raise ConfigError(f"{name}[{i}] = {t} must be finite and {'> 0' if positive else '>= 0'}")
    return vals


def check_times(tF, tB, tW, c) -> tuple[int, list[float], list[float], list[float], list[float]]:
    """Per-stage op times and per-link delays of one pipeline, checked: (S, tF, tB, tW, c)."""
    S = len(tF)
    if S < 1:
        raise ConfigError("tF is empty: need one forward time per stage (num_stages >= 1)")
    return (S, check_vec("tF", tF, S, positive=True), check_vec("tB", tB, S, positive=True),
            check_vec("tW", tW, S, positive=True), check_vec("c", c, S - 1, positive=False))


def _check_warmup(warmup: Sequence[int], num_stages: int, num_microbatches: int) -> list[int]:
    if len(warmup) != num_stages:
        raise ConfigError(f"warmup has {len(warmup)} entries, expected num_stages {num_stages}")
    for i, x in enumerate(warmup):
        if x < 1:
            raise ConfigError(f"warm-up quota {x} on stage {i} must be >= 1")
        if x > num_microbatches:
            raise ConfigError(f"warm-up quota {x} on stage {i} exceeds num_microbatches {num_microbatches}")
        if i and x > warmup[i - 1]:
            raise ConfigError(f"warm-up quota {x} on stage {i} exceeds {warmup[i - 1]} on stage {i - 1} "
                              "(quotas must be non-increasing, ADAPTRA's lemma x_i >= x_i+1: a stage would wait for "
                              "forwards its upstream holds back)")
    return [int(x) for x in warmup]


_B, _F, _W = 0, 1, 2  # kind indices, in priority order after warm-up
_OPS = (Op.B, Op.F, Op.W)


class _Pipeline:
    """State of the list scheduler; drivers call ``complete`` and ``decide``.

    Kinds are small ints (not ``Op``) and actions come from a per-build cache: this loop runs
    once per op of a 128x1024 pipeline, where enum hashing and dataclass construction show.
    """

    def __init__(self, dur: list[list[int]], link: list[int], warmup: list[int], n: int,
                 wait_first_backward: bool, limit_inflight: bool):
        S = self.S = len(warmup)
        self.N = n
        self.dur, self.link, self.warmup = dur, link, warmup  # dur[kind][stage] in steps
        self.wait_first_backward, self.limit_inflight = wait_first_backward, limit_inflight
        # per stage and kind: FIFO of (ready_step, mb). Every kind reaches a stage in micro-batch
        # order with non-decreasing ready steps (stage 0 owns all F at step 0; each stage runs
        # a kind lowest-id-first; link delays are constant), so the ready ops are always a
        # prefix and "lowest micro-batch among ready" is the head. _push asserts it.
        self.queue = [[deque(), deque(), deque()] for _ in range(S)]
        self.f_done = [0] * S
        self.b_done = [0] * S
        self.inflight = [0] * S
        self.busy_until = [0] * S
        self.running: list[Optional[tuple[int, int]]] = [None] * S
        self.remaining = 3 * n * S
        self.actions = [[Action(op, j) for j in range(n)] for op in _OPS]
        self.order: Schedule = {s: [] for s in range(S)}
        self.starts: dict[int, list[int]] = {s: [] for s in range(S)}
        self.ends: dict[int, list[int]] = {s: [] for s in range(S)}
        self.queue[0][_F].extend((0, j) for j in range(n))
        self.on_ready = None  # event driver hook: (stage, ready_step)

    def _push(self, stage: int, kind: int, ready_step: int, mb: int) -> None:
        q = self.queue[stage][kind]
        if q and (q[-1][0] > ready_step or q[-1][1] > mb):
            raise AssertionError(f"{_OPS[kind].value}{mb} reaches stage {stage} out of order")
        q.append((ready_step, mb))
        if self.on_ready is not None:
            self.on_ready(stage, ready_step)

    def complete(self, s: int, now: int) -> None:
        kind, mb = self.running[s]
        self.running[s] = None
        self.remaining -= 1
        if kind == _F:
            if s + 1 < self.S:
                self._push(s + 1, _F, now + self.link[s], mb)
            else:
                self._push(s, _B, now, mb)
        elif kind == _B:
            self.inflight[s] -= 1
            self.b_done[s] += 1
            self._push(s, _W, now, mb)
            if s > 0:
                self._push(s - 1, _B, now + self.link[s - 1], mb)

    def _pick(self, s: int, now: int) -> Optional[int]:
        qb, qf, qw = self.queue[s]
        x = self.warmup[s]
        f_ok = bool(qf) and qf[0][0] <= now and (not self.limit_inflight or self.inflight[s] < x)
        if self.f_done[s] < x:
            return _F if f_ok else None
        if self.wait_first_backward and self.b_done[s] == 0:
            f_ok = False
        if qb and qb[0][0] <= now:
            return _B
        if f_ok:
            return _F
        if qw and qw[0][0] <= now:
            return _W
        return None

    def decide(self, s: int, now: int) -> Optional[int]:
        """If stage s is idle at ``now``, start the op the rules pick; return its end step."""
        if self.running[s] is not None:
            return None
        kind = self._pick(s, now)
        if kind is None:
            return None
        mb = self.queue[s][kind].popleft()[1]
        if kind == _F:
            self.f_done[s] += 1
            self.inflight[s] += 1
        end = now + self.dur[kind][s]
        self.running[s] = (kind, mb)
        self.busy_until[s] = end
        self.order[s].append(self.actions[kind][mb])
        self.starts[s].append(now)
        self.ends[s].append(end)
        return end

    def stuck_report(self) -> str:
        parts = []
        for s in range(self.S):
            done = len(self.order[s])
            if done < 3 * self.N:
                parts.append(f"stage {s} ran {done}/{3 * self.N} ops (F done {self.f_done[s]}, "
                             f"quota {self.warmup[s]}, in flight {self.inflight[s]})")
        return "; ".join(parts[:4]) + ("; ..." if len(parts) > 4 else "")


def _run_event(p: _Pipeline, max_steps: int) -> None:
    # (step, 0=completion | 1=wake, stage). Completions at a step are all applied before any
    # stage decides at that step, exactly as the stepped loop does.
    events: list[tuple[int, int, int]] = []
    queued: set[tuple[int, int]] = set()

    def wake(stage: int, at: int) -> None:
        if p.running[stage] is not None and p.busy_until[stage] >= at:
            return  # its completion wakes it, and by then this op is ready too
        if (at, stage) not in queued:
            queued.add((at, stage))
            heapq.heappush(events, (at, 1, stage))

    p.on_ready = wake
    wake(0, 0)
    while events:
        now, kind, s = heapq.heappop(events)
        if now > max_steps:
            raise ScheduleError(f"schedule builder passed its bound of {max_steps} steps without finishing: "
                                + p.stuck_report())
        if kind == 0:
            p.complete(s, now)
            wake(s, now)
            continue
        queued.discard((now, s))
        end = p.decide(s, now)
        if end is not None:
            heapq.heappush(events, (end, 0, s))
    if p.remaining:
        raise ScheduleError("schedule builder deadlocked: " + p.stuck_report())


def _run_stepped(p: _Pipeline, max_steps: int) -> None:
    now = 0
    while p.remaining:
        if now > max_steps:
            raise ScheduleError(f"schedule builder passed its bound of {max_steps} steps without finishing: "
                                + p.stuck_report())
        for s in range(p.S):
            if p.running[s] is not None and p.busy_until[s] == now:
                p.complete(s, now)
        for s in range(p.S):
            p.decide(s, now)
        now += 1


def build_timeline(tF: Sequence[float], tB: Sequence[float], tW: Sequence[float], c: Sequence[float],
                   warmup: Sequence[int], *, num_microbatches: int,
                   delta_s: Optional[float] = None, steps_per_op: int = 30,
                   wait_first_backward: bool = True, limit_inflight: bool = True,
                   method: Literal["event", "stepped"] = "event",
                   max_steps: Optional[int] = None) -> Timeline:
    """Run Alg. 3/4 and return the schedule with its simulated timing.

    ``num_microbatches`` is required (the quotas do not determine it). ``delta_s`` defaults to
    the longest op over ``steps_per_op``. The build is held to ``max_steps``: by default
    ``3·N·S·⌈t_o/δ⌉`` plus ``2·N·Σ⌈c_i/δ⌉`` (every message's link delay), i.e. the time
    of running all work and all messages one after another, which no schedule can exceed while
    something is always running or in transit. Past it a ``ScheduleError`` is raised instead
    of looping on; a deadlock (nothing running, nothing in transit) is reported at once.
    """
    S, tF, tB, tW, c = check_times(tF, tB, tW, c)
    n = num_microbatches
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"num_microbatches must be an integer >= 1, got {n!r}")
    warmup = _check_warmup(warmup, S, n)
    if steps_per_op < 1:
        raise ConfigError(f"steps_per_op must be >= 1, got {steps_per_op}")
    t_o = max(tF + tB + tW)
    delta = float(delta_s) if delta_s is not None else t_o / steps_per_op
    if not delta > 0:
        raise ConfigError(f"delta_s must be > 0, got {delta_s}")
    dur = [[_steps(t, delta, 1) for t in times] for times in (tB, tF, tW)]  # indexed _B, _F, _W
    link = [_steps(x, delta, 0) for x in c]
    if max_steps is None:
        max_steps = 3 * n * S * _steps(t_o, delta, 1) + 2 * n * sum(link)
    p = _Pipeline(dur, link, warmup, n, wait_first_backward, limit_inflight)
    if method == "event":
        _run_event(p, max_steps)
    elif method == "stepped":
        _run_stepped(p, max_steps)
    else:
        raise ConfigError(f"method must be 'event' or 'stepped', got {method!r}")
    return Timeline(p.order, p.starts, p.ends, delta, max_steps)


def build_schedule(tF: Sequence[float], tB: Sequence[float], tW: Sequence[float], c: Sequence[float],
                   warmup: Sequence[int], *, num_microbatches: int,
                   delta_s: Optional[float] = None, steps_per_op: int = 30,
                   wait_first_backward: bool = True, limit_inflight: bool = True,
                   method: Literal["event", "stepped"] = "event") -> Schedule:
    """Compute-only schedule (F, B, W per stage, B/W split) from Alg. 3/4; see :func:`build_timeline`."""
    return build_timeline(tF, tB, tW, c, warmup, num_microbatches=num_microbatches, delta_s=delta_s,
                          steps_per_op=steps_per_op, wait_first_backward=wait_first_backward,
                          limit_inflight=limit_inflight, method=method).schedule

