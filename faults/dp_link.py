"""Data-parallel link delay (ADAPTRA's sim scenario S5, `impl/adaptra/README.md`, "Sim-mode
scenario models"): which stage's gradient all-reduce crosses a slow link at an iteration, and
one-line errors for impossible specs. Sim only."""
from __future__ import annotations

from impl.common.api import ConfigError


def resolve_stage(stage: int, stages: int) -> int:
    return int(stage) + stages if int(stage) < 0 else int(stage)


def validate_dp_link_delay(fault, stages: int, dp: int) -> None:
    if getattr(fault, "kind", None) != "dp_link_delay":
        return
    s = resolve_stage(fault.stage, stages)
    if not 0 <= s < stages:
        raise ConfigError(f"fault.stage: stage {fault.stage} does not exist in a {stages}-stage pipeline "
                          f"(0 <= stage < {stages}, or negative from the last)")
    if dp < 2:
        raise ConfigError(f"fault.kind dp_link_delay: stage {s} has no data-parallel link (workload.dp = {dp}, needs >= 2)")
    if fault.delay_s < 0:
        raise ConfigError(f"fault.delay_s must be >= 0 seconds, got {fault.delay_s}")
    if fault.start_iter < 0:
        raise ConfigError(f"fault.start_iter must be >= 0, got {fault.start_iter}")
    if fault.stop_iter is not None and fault.stop_iter <= fault.start_iter:
        raise ConfigError(f"fault.stop_iter ({fault.stop_iter}) must be > fault.start_iter ({fault.start_iter})")
    if fault.detection not in ("oracle", "measured"):
        raise ConfigError(f"fault.detection: unknown value {fault.detection!r} (one of: oracle, measured)")


def dp_link_delays_at(fault, iteration: int, stages: int) -> dict[int, float]:
    """``{stage: seconds}``: per-message delay on the slow DP link of ``stage`` (empty if none)."""
    if getattr(fault, "kind", None) != "dp_link_delay":
        return {}
    if iteration < fault.start_iter or (fault.stop_iter is not None and iteration >= fault.stop_iter):
        return {}
    return {resolve_stage(fault.stage, stages): float(fault.delay_s)} if fault.delay_s > 0 else {}
