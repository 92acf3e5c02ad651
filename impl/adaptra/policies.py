"""The ADAPTRA family's schedules and P2P paths as registered components (what each
``system.schedule`` / ``system.comm`` / ``system.inline_model`` name stands for).

| schedule    | sim plan                                           | real mode                       |
|-------------|----------------------------------------------------|---------------------------------|
| adaptra     | Alg. 2 + Alg. 3/4 from the delays the scheduler sees | re-planned each iteration from the padded op time |
| zb          | ZB, delay-blind, <= 2S-1 stored                    | the named generator             |
| zb_uncapped | ZB with no activation cap, from profiled op times  | the named generator             |
| 1f1b, gpipe | the named generator                                | the named generator             |

| comm      | sim model (until delegated)                 | runtime path |
|-----------|---------------------------------------------|--------------|
| inline    | ``system.inline_model`` (fifo or blocking)  | inline       |
| in_stream | depth-``queue_depth`` FIFO on the stream    | fifo         |
| delegated | host delegates once used, FIFO before       | delegated    |
| latency   | no queueing at all (the simulator reference [R]) | (sim only) |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from impl.adaptra.builder import AdaptraPlanner, adaptra_schedule
from impl.common.registry import Registry
from impl.common.schedule.generators import generate, zero_bubble_uncapped
from impl.common.schedule.ir import Schedule
from impl.common.sim.pipeline import CommModel

# (cfg, tF, tB, tW, detected delays {(i, i+1): s}, stages, micro-batches) -> (schedule, warm-up quotas or None)
PlanFn = Callable[..., "tuple[Schedule, Optional[list]]"]


@dataclass(frozen=True)
class PipelineSchedule:
    plan: PlanFn
    # re-planned whenever the delays the scheduler sees change (one plan per delay table)
    delay_aware: bool = False
    # real mode's per-iteration planner (cfg, workload) -> schedule provider; None = the
    # runtime's named generator of this schedule
    real_planner: Optional[Callable] = None


def _named(name: str) -> PlanFn:
    return lambda cfg, tF, tB, tW, detected, S, N: (generate(name, S, N), None)


def _plan_adaptra(cfg, tF, tB, tW, detected, S, N):
    c = [detected.get((i, i + 1), 0.0) for i in range(S - 1)]
    return adaptra_schedule(tF, tB, tW, c, N, formula=cfg.adapt_formula, steps_per_op=cfg.steps_per_op)


def _plan_zb_uncapped(cfg, tF, tB, tW, detected, S, N):
    # The paper's simulator builds its uncapped ZB from the profiled op times (at c = 0).
    return zero_bubble_uncapped(S, N, tF, tB, tW, steps_per_op=cfg.steps_per_op), None


def _adaptra_planner(cfg, wl) -> AdaptraPlanner:
    return AdaptraPlanner(wl.op_pad_s, wl.stages, wl.num_microbatches, cfg.adapt_formula, cfg.steps_per_op)


SCHEDULES: Registry[PipelineSchedule] = Registry("value", "system.schedule")
SCHEDULES.add("adaptra", PipelineSchedule(_plan_adaptra, delay_aware=True, real_planner=_adaptra_planner))
SCHEDULES.add("zb", PipelineSchedule(_named("zb")))
SCHEDULES.add("zb_uncapped", PipelineSchedule(_plan_zb_uncapped))
SCHEDULES.add("1f1b", PipelineSchedule(_named("1f1b")))
SCHEDULES.add("gpipe", PipelineSchedule(_named("gpipe")))


def _fifo(cfg) -> CommModel:
    return CommModel(kind="in_stream", queue_depth=cfg.queue_depth, batch_p2p=cfg.p2p_order == "batch")


def _blocking(cfg) -> CommModel:
    # Sends in schedule order on the compute thread (the FIFO model put the CPU runtime's
    # 1F1B 34% under real at 60 ms; fidelity/pipeline).
    return CommModel(kind="blocking", batch_p2p=False)


# Sim model of comm=inline: fifo = a depth-1 FIFO (Megatron's async P2P on GPU, the paper
# figures); blocking = the send holds the compute stream until delivered (this repo's CPU runtime).
INLINE_MODELS: Registry[Callable[..., CommModel]] = Registry("value", "system.inline_model")
INLINE_MODELS.add("fifo", _fifo)
INLINE_MODELS.add("blocking", _blocking)


@dataclass(frozen=True)
class CommPath:
    # the sim's P2P model while traffic is not on host delegates
    stream: Callable[..., CommModel]
    # what the executor calls this path (ours: in_stream = its fifo); None = sim only
    runtime: Optional[str]
    # traffic moves to host delegates (once used: system.delegate_when), and an RNIC failure fails over
    delegated: bool = False


COMMS: Registry[CommPath] = Registry("value", "system.comm")
COMMS.add("inline", CommPath(lambda cfg: INLINE_MODELS.get(cfg.inline_model)(cfg), "inline"))
COMMS.add("in_stream", CommPath(_fifo, "fifo"))
COMMS.add("delegated", CommPath(_fifo, "delegated", delegated=True))
COMMS.add("latency", CommPath(lambda cfg: CommModel(kind="latency"), None))
