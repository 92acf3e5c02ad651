"""A calibrated profile's Megatron knobs carried to another GPU by datasheet ratios (the papers
ran on A800 / A100 / H800; the measured launches are H100's).

- Kernel tables: carried by :func:`impl.common.megatron.kernels.carried`: every time scaled by
  the bf16 peak ratio (compute-bound: an assumption, Ampere kernels may reach a different
  fraction of their peak; no Ampere launch or probe is in the data) and floored by its bytes over
  the target's HBM bandwidth (memory-bound); the time factors over the tables are kept (the same
  software's kernels over the table's).
- Intra- and inter-node bus bandwidth: scaled by the target's datasheet link over the base's
  (``intra_node_bw_bytes_per_s``, ``inter_node_bw_bytes_per_s``), so H800's capped NVLink and
  A100's HDR IB are priced from the measured H100 efficiency of those links.
- Per-layer and per-iteration overheads (host work) and the bytes per token, per logit and fixed
  (software): kept.
- Allocatable memory: the target's memory less the base's headroom (memory - allocatable).
"""
from __future__ import annotations

import dataclasses

from impl.common.api import ConfigError
from impl.common.hardware import HardwareProfile


def derived_profile(base: HardwareProfile, target: HardwareProfile, name: str = "") -> HardwareProfile:
    if base.megatron is None:
        raise ConfigError(f"--from: profile {base.name} has no fitted Megatron knobs to derive from")
    k = base.megatron
    for f in ("intra_node_bw_bytes_per_s", "inter_node_bw_bytes_per_s", "memory_bytes"):
        if not getattr(base, f) > 0 or not getattr(target, f) > 0:
            raise ConfigError(f"hardware.{f}: must be > 0 in both {base.name} and {target.name} to derive knobs")
    if base.kernels is None:
        raise ConfigError(f"--from: profile {base.name} has no kernel tables to carry")
    from .kernels import carried

    tables = carried(base.kernels, base.peak_flops["bf16"], base.memory_bw_bytes_per_s, target)
    headroom = base.memory_bytes - k.allocatable_bytes
    knobs = dataclasses.replace(
        k,
        intra_node_bus_bw_bytes_per_s=k.intra_node_bus_bw_bytes_per_s * target.intra_node_bw_bytes_per_s
        / base.intra_node_bw_bytes_per_s,
        inter_node_bus_bw_bytes_per_s=k.inter_node_bus_bw_bytes_per_s * target.inter_node_bw_bytes_per_s
        / base.inter_node_bw_bytes_per_s,
        allocatable_bytes=target.memory_bytes - headroom)
    if knobs.allocatable_bytes <= 0:
        raise ConfigError(f"--derive: {target.name}'s memory is below {base.name}'s headroom")
    cal = {"derived_from": base.name, "base_calibration": dict(base.calibration),
           "rule": "impl/common/megatron/derive.py", "measured_on_target": False}
    return dataclasses.replace(target, name=name or f"{target.name}-megatron", megatron=knobs, kernels=tables,
                               calibration=cal,
                               source=f"{target.source}; Megatron knobs derived from {base.name} by datasheet ratios")
