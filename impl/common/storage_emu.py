"""Storage/bandwidth emulator: a file read that takes as long as a slower store would.

A real read of the local file happens (the bytes are the file's); the call then sleeps until
``latency_s + emulated_bytes / bandwidth`` (times ``time_scale``) has passed since it started,
so a loader behind it sees a remote store's bandwidth cap and per-call latency. ``emulated_bytes``
lets a tiny file stand for a paper-scale one (e.g. an SDXL LoRA of ~0.4 GB). Every run that
uses it names ``label()`` in ``RunResult.emulated``. SwiftDiffusion's LoRA loaders read through it.
"""
from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass
from typing import Optional

from impl.common.api import ConfigError


@dataclass(frozen=True)
class EmulatedStorage:
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    time_scale: float = 1.0  # tau: emulated seconds -> wall seconds (shrinks paper-scale times)
    name: str = "storage"

    def __post_init__(self):
        if not self.bandwidth_bytes_per_s > 0:
            raise ConfigError(f"{self.name}.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        if self.latency_s < 0 or self.time_scale < 0:
            raise ConfigError(f"{self.name}.latency_s and time_scale must be >= 0, got {self.latency_s}, "
                              f"{self.time_scale}")

    def duration_s(self, nbytes: float) -> float:
        """Wall seconds one read of ``nbytes`` (emulated size) takes."""
        return (self.latency_s + nbytes / self.bandwidth_bytes_per_s) * self.time_scale

    def read(self, path, emulated_bytes: Optional[float] = None) -> bytes:
        t0 = time.perf_counter()
        data = pathlib.Path(path).read_bytes()
        end = t0 + self.duration_s(len(data) if emulated_bytes is None else emulated_bytes)
        while (left := end - time.perf_counter()) > 0:
            time.sleep(min(left, 0.05))
        return data

    def label(self) -> str:
        return (f"{self.name}: file reads capped at {self.bandwidth_bytes_per_s / 1e9:.3g} GB/s + "
                f"{self.latency_s * 1e3:.3g} ms per call, x{self.time_scale:g} time scale (emulated)")
