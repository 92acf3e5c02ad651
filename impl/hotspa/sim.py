"""HotSPa sim mode (spec hotspa 6): being built."""
from __future__ import annotations

from impl.common.api import ConfigError


def check_sim(system, wl, hardware) -> None:
    raise ConfigError(f"mode: system {system.name!r} has no sim mode yet")


def run_sim(system, job):
    raise ConfigError(f"mode: system {system.name!r} has no sim mode yet")
