"""Discrete-event simulation: a deterministic event core and the pipeline-parallel simulator."""
from impl.common.sim.delays import normalize_delays
from impl.common.sim.events import EventLoop
from impl.common.sim.pipeline import (
    CommModel,
    Message,
    OpSpan,
    PipelineSimResult,
    StageBreakdown,
    simulate_iteration,
    simulate_iterations,
)

__all__ = [
    "CommModel", "EventLoop", "Message", "OpSpan", "PipelineSimResult", "StageBreakdown",
    "normalize_delays", "simulate_iteration", "simulate_iterations",
]
