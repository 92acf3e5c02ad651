"""LobRA real mode (spec 5): being built."""
from __future__ import annotations

from impl.common.api import ConfigError


def check_real(system, wl, hardware) -> None:
    raise ConfigError(f"mode: system {system.name!r} has no real mode yet")


def run_real(system, job):
    raise ConfigError(f"mode: system {system.name!r} has no real mode yet")
