"""Compute-slowdown injection: the per-GPU slowdown factor x_g in force at an iteration.

One function serves both modes: the simulator multiplies each GPU's compute time by it, the
real runtime pads each op (sleep) to ``nominal * factor`` (our reconstruction: the public
Malleus code ships no injector; `impl/malleus/README.md`, "Experiments") and the GEMM probe of a
suspended GPU is padded the same way.
"""
from __future__ import annotations

import math

from impl.common.errors import ConfigError


def _check_event(gpus, factor, factors, num_gpus: int, where: str) -> None:
    for g in gpus:
        if not 0 <= int(g) < num_gpus:
            raise ConfigError(f"{where}.gpus: GPU {g} does not exist (the workload has {num_gpus} GPUs: 0..{num_gpus - 1})")
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"{where}.gpus: {list(gpus)} lists a GPU twice")
    if factors and len(factors) != len(gpus):
        raise ConfigError(f"{where}.factors: {len(factors)} factors for {len(gpus)} GPUs")
    for f in (list(factors) or [factor]):
        if not (f > 0 and math.isfinite(f)):
            raise ConfigError(f"{where}.factor: slowdown factors must be positive and finite, got {f}")


def validate_compute_slowdown(fault, num_gpus: int) -> None:
    """One-line ConfigError for a slowdown on a GPU that does not exist, bad factors or ranges."""
    if getattr(fault, "kind", None) != "compute_slowdown":
        return
    _check_event(fault.gpus, fault.factor, fault.factors, num_gpus, "fault")
    severity = getattr(fault, "severity", 1.0)
    if not (severity >= 0 and math.isfinite(severity)):
        raise ConfigError(f"fault.severity must be >= 0 and finite, got {severity}")
    if fault.start_iter < 0:
        raise ConfigError(f"fault.start_iter must be >= 0, got {fault.start_iter}")
    if fault.stop_iter is not None and fault.stop_iter <= fault.start_iter:
        raise ConfigError(f"fault.stop_iter ({fault.stop_iter}) must be > fault.start_iter ({fault.start_iter})")
    last = -1
    for k, ev in enumerate(fault.trace):
        _check_event(ev.gpus, ev.factor, ev.factors, num_gpus, f"fault.trace[{k}]")
        if ev.start_iter <= last:
            raise ConfigError(f"fault.trace[{k}].start_iter {ev.start_iter} must be after the previous event's ({last})")
        last = ev.start_iter


def slowdown_at(fault, iteration: int, num_gpus: int) -> list[float]:
    """Factor per GPU at ``iteration`` (1.0 = nominal). A non-empty trace replaces gpus/factor:
    its last event with start_iter <= iteration holds; start/stop_iter bound the whole fault;
    ``severity`` scales each factor's excess over 1."""
    x = [1.0] * num_gpus
    if getattr(fault, "kind", None) != "compute_slowdown":
        return x
    if iteration < fault.start_iter or (fault.stop_iter is not None and iteration >= fault.stop_iter):
        return x
    gpus, factor, factors = fault.gpus, fault.factor, fault.factors
    if fault.trace:
        current = [ev for ev in fault.trace if ev.start_iter <= iteration]
        if not current:
            return x
        gpus, factor, factors = current[-1].gpus, current[-1].factor, current[-1].factors
    severity = float(getattr(fault, "severity", 1.0))
    for k, g in enumerate(gpus):
        f = float(factors[k]) if factors else float(factor)
        x[int(g)] = f if severity == 1.0 else 1.0 + severity * (f - 1.0)
    return x


def change_iterations(fault, iterations: int) -> list[int]:
    """Iterations at which the injected factors change (for reports and S7)."""
    if getattr(fault, "kind", None) != "compute_slowdown":
        return []
    pts = {fault.start_iter} | ({fault.stop_iter} if fault.stop_iter is not None else set())
    pts |= {ev.start_iter for ev in fault.trace}
    return sorted(p for p in pts if 0 < p < iterations)
