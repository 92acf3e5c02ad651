"""Measured host->GPU adapter load times, interpolated by bytes (CaraServe, arXiv
2401.11240: v1 Fig. 3-right; ATC'25 Fig. 4).

The paper measured how long one adapter takes to become usable on the GPU, by rank, on its own
testbeds; those figures include everything a real load costs beyond bytes / peak bandwidth
(per-tensor copies, allocation, scatter into the pool), which the roofline load [R]
(22 GB/s pinned + 20 us per tensor) leaves out: 20.6 ms measured vs ~8 ms roofline for the
same rank-64 q,k,v adapter. A table maps the adapter's **bytes** to a time, piecewise linear
through the measured points and extended past either end by the nearest segment, so an adapter
of another shape (4 sites instead of 3, another model, a TP shard) is priced by how many bytes
it moves rather than by its rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class MeasuredLoadProfile:
    name: str
    source: str
    # The measured adapter's shape: bytes = layers x sites x 2 x hidden x rank x dtype_bytes.
    layers: int
    hidden: int
    sites: int
    dtype_bytes: int
    ranks: tuple
    times_s: tuple

    def bytes_of(self, rank: int) -> float:
        return float(self.layers * self.sites * 2 * self.hidden * rank * self.dtype_bytes)

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        return np.array([self.bytes_of(r) for r in self.ranks]), np.array(self.times_s, dtype=float)

    def load_s(self, nbytes: float) -> float:
        """Time to load ``nbytes``: linear between measured points, the end segments extended
        beyond them (clipped at 0)."""
        x, y = self.points()
        if nbytes <= x[0]:
            k = 0
        elif nbytes >= x[-1]:
            k = len(x) - 2
        else:
            return float(np.interp(nbytes, x, y))
        slope = (y[k + 1] - y[k]) / (x[k + 1] - x[k])
        return max(0.0, float(y[k] + slope * (nbytes - x[k])))


_LLAMA2_7B = dict(layers=32, hidden=4096, dtype_bytes=2)

# v1 (arXiv 2401.11240) Fig. 3-right: Llama2-7B, LoRA on Wq, Wk, Wv, one A10.
A10_V1_FIG3 = MeasuredLoadProfile(
    name="a10:caraserve-v1-fig3", source="CaraServe v1 (arXiv 2401.11240) Fig. 3-right, A10, Llama2-7B q,k,v",
    sites=3, ranks=(8, 32, 64, 128), times_s=(4.9e-3, 11.8e-3, 20.6e-3, 50.7e-3), **_LLAMA2_7B)
# ATC'25 (Toppings) Fig. 4, A100 testbed. The figure's adapter shape is not
# stated; [R] the same Llama2-7B q,k,v adapter as v1's.
A100_ATC_FIG4 = MeasuredLoadProfile(
    name="a100:toppings-atc-fig4", source="Toppings ATC'25 Fig. 4, A100; [R] Llama2-7B q,k,v shape",
    sites=3, ranks=(32, 64, 128, 256), times_s=(13.6e-3, 26.1e-3, 44.5e-3, 73.6e-3), **_LLAMA2_7B)

MEASURED_LOAD_PROFILES = {"a10": A10_V1_FIG3, "a100-80g": A100_ATC_FIG4, "a100-40g": A100_ATC_FIG4}
LOAD_MODELS = ("auto", "measured", "roofline")


def measured_profile(hardware_name: Optional[str]) -> Optional[MeasuredLoadProfile]:
    return MEASURED_LOAD_PROFILES.get(hardware_name or "")
