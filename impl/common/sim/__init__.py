"""Discrete-event simulation: a deterministic event core and the pipeline-parallel simulator."""
from .delays import normalize_delays
from .engine import Engine
from .pipeline import (
    CommModel,
    Message,
    OpSpan,
    SimResult,
    StageBreakdown,
    simulate_iteration,
    simulate_iterations,
)

__all__ = [
    "CommModel", "Engine", "Message", "OpSpan", "SimResult", "StageBreakdown",
    "normalize_delays", "simulate_iteration", "simulate_iterations",
]
