"""A calibrated profile's Megatron knobs carried to another GPU by datasheet ratios (the papers
ran on A800 / A100 / H800; the measured launches are H100's).

- Kernel tables: carried by :func:`impl.common.megatron.kernels.carried`: every time scaled by
  the bf16 peak ratio (compute-bound: an assumption, Ampere kernels may reach a different
  fraction of their peak; no Ampere launch or probe is in the data) and floored by its bytes over
  the target's HBM bandwidth (memory-bound); the time factors over the tables are kept (the same
  software's kernels over the table's).
- Intra- and inter-node communication efficiencies: kept (a fraction of each link's datasheet
  rate); the target's own links (``intra_node_bw_bytes_per_s``, ``inter_node_bw_bytes_per_s``,
  ``nics_per_node``) price its collectives through :mod:`impl.common.collectives`, so H800's
  capped NVLink and A100's HDR IB are priced at the measured H100 efficiency of those links.
- Per-layer and per-iteration overheads (host work) and the bytes per token, per logit and fixed
  (software): kept.
- Allocatable memory: the target's memory less the base's headroom (memory - allocatable).

Every profile prices a Megatron-like step through one path (:func:`step_profile`): a profile with
fitted knobs and kernel tables as it is; a datasheet profile (``measured: false``) with the knobs
and tables of its ``megatron.carried_from`` profile (default ``h100-megatron``, the fit to measured H100
launches) carried by the rules above, the same rule that wrote the shipped ``*-megatron`` profiles,
so ``hardware=a800-80g`` and ``hardware=a800-80g-megatron`` price a step alike; a measured host
profile (``system=harness/calibrate``: its peaks are achieved rates) with flat kernel tables at its
measured matmul rate and its measured links; a profile with probed tables and no fit yet, with
those tables and factors of 1 (the fit's starting point).
"""
from __future__ import annotations

import dataclasses

from impl.common.api import ConfigError
from impl.common.hardware import HardwareProfile, KernelTables, MegatronKnobs, load_hardware

from .kernels import carried, flat_tables

_STEP_PROFILES: dict = {}
_CARRYING: set = set()  # profiles whose step model is being carried (a carried_from loop is an error)


def derived_profile(base: HardwareProfile, target: HardwareProfile, name: str = "") -> HardwareProfile:
    if base.megatron.knobs is None:
        raise ConfigError(f"--from: profile {base.name} has no fitted Megatron knobs to derive from")
    k = base.megatron.knobs
    for f in ("intra_node_bw_bytes_per_s", "inter_node_bw_bytes_per_s"):
        if not getattr(base, f) > 0 or not getattr(target, f) > 0:
            raise ConfigError(f"hardware.{f}: must be > 0 in both {base.name} and {target.name} to derive knobs")
    if not base.memory_bytes > 0:
        raise ConfigError(f"hardware.memory_bytes: must be > 0 in {base.name} to derive knobs")
    if base.megatron.kernels is None:
        raise ConfigError(f"--from: profile {base.name} has no kernel tables to carry")
    tables = carried(base.megatron.kernels, base.peak_flops["bf16"], base.memory_bw_bytes_per_s, target)
    headroom = base.memory_bytes - k.allocatable_bytes
    knobs = dataclasses.replace(k, allocatable_bytes=target.memory_bytes - headroom)
    if target.memory_bytes <= 0:  # a profile that states no memory prices time only: nothing allocatable
        knobs = dataclasses.replace(knobs, allocatable_bytes=0.0)
    elif knobs.allocatable_bytes <= 0:
        raise ConfigError(f"--derive: {target.name}'s memory is below {base.name}'s headroom")
    cal = {"derived_from": base.name, "base_calibration": dict(base.calibration),
           "rule": "impl/common/megatron/derive.py", "measured_on_target": False}
    return dataclasses.replace(target.with_megatron(knobs=knobs, kernels=tables), name=name or f"{target.name}-megatron",
                               calibration=cal,
                               source=f"{target.source}; Megatron knobs derived from {base.name} by datasheet ratios")


def _key(hw: HardwareProfile) -> str:
    # every field _carried / _neutral read: an override of any of them is another step profile
    return repr((hw.name, hw.measured, sorted((hw.peak_flops or {}).items()), hw.memory_bytes,
                 hw.memory_bw_bytes_per_s, hw.gpus_per_node, hw.intra_node_bw_bytes_per_s, hw.inter_node_bw_bytes_per_s, hw.nics_per_node,
                 hw.intra_node_latency_s, hw.inter_node_latency_s, hw.comm_efficiency, hw.allreduce_bw_bytes_per_s,
                 hw.megatron))


def step_profile(hw: HardwareProfile) -> HardwareProfile:
    """``hw`` with the knobs and kernel tables (``megatron.knobs`` / ``megatron.kernels``) the step
    model prices it with (see the module doc); cached per profile figures."""
    m = hw.megatron
    if m.knobs is not None and m.kernels is not None and m.kernels.gemm:
        return hw
    key = _key(hw)
    if key not in _STEP_PROFILES:
        has_tables = m.kernels is not None and bool(m.kernels.gemm)
        _STEP_PROFILES[key] = _neutral(hw) if hw.measured or has_tables else _carried(hw)
    return _STEP_PROFILES[key]


def step_knobs(hw: HardwareProfile) -> MegatronKnobs:
    """The step model's knobs for ``hw``: fitted, else derived by :func:`step_profile`."""
    return hw.megatron.knobs if hw.megatron.knobs is not None else step_profile(hw).megatron.knobs


def with_knob_overrides(hw: HardwareProfile, given: dict) -> HardwareProfile:
    """``hw`` with some of its step-model knobs set (``hardware.megatron.knobs.<knob>=...`` on a
    profile without fitted knobs): the others are the knobs the profile is priced with anyway
    (carried from ``megatron.carried_from``, or a measured host's own), so one override moves one
    knob and never resets the rest to :class:`MegatronKnobs`' defaults."""
    names = {f.name for f in dataclasses.fields(MegatronKnobs)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise ConfigError(f"hardware.megatron.knobs.{unknown[0]}: not a step-model knob (one of: {', '.join(sorted(names))})")
    base = step_knobs(hw.with_megatron(knobs=None))
    return hw.with_megatron(knobs=dataclasses.replace(base, **{k: float(v) for k, v in given.items()}))


def tables_of(hw: HardwareProfile) -> KernelTables:
    """The kernel tables the step model prices ``hw`` with."""
    return step_profile(hw).megatron.kernels


def comm_efficiencies(hw: HardwareProfile) -> dict:
    """The step model's link efficiencies (fitted, or carried from ``megatron.carried_from``) as
    :func:`impl.common.collectives.collective` keyword arguments, so every pricer's collectives
    run at the rate the step model's do."""
    k = step_knobs(hw)
    return {"intra_efficiency": k.intra_node_comm_efficiency, "inter_efficiency": k.inter_node_comm_efficiency}


def _carried(hw: HardwareProfile) -> HardwareProfile:
    base_name = hw.megatron.carried_from
    if not base_name or base_name == hw.name or base_name in _CARRYING:
        raise ConfigError(f"hardware {hw.name}: megatron.carried_from must name a fitted profile (got {base_name!r}"
                          + (f", a loop through {', '.join(sorted(_CARRYING))})" if base_name in _CARRYING else ")"))
    _CARRYING.add(hw.name)
    try:
        base = step_profile(load_hardware(base_name))
    finally:
        _CARRYING.discard(hw.name)
    derived = derived_profile(base, hw, name=hw.name)
    if hw.megatron.knobs is not None:  # fitted knobs without tables: keep the knobs, carry the tables
        derived = derived.with_megatron(knobs=hw.megatron.knobs)
    return dataclasses.replace(derived, calibration=hw.calibration or derived.calibration, source=hw.source)


def _neutral(hw: HardwareProfile) -> HardwareProfile:
    """A measured host, or a profile with measured kernel tables and no fit yet (what the fit
    starts from): its own tables (a host's: flat at its measured matmul rate), factors 1, its
    links at ``comm_efficiency`` (1 on a measured profile), all of its memory."""
    rate_dtype = "bf16" if "bf16" in (hw.peak_flops or {}) else "fp32"
    knobs = hw.megatron.knobs or MegatronKnobs(
        intra_node_comm_efficiency=hw.comm_efficiency, inter_node_comm_efficiency=hw.comm_efficiency,
        allocatable_bytes=hw.memory_bytes)
    own = hw.megatron.kernels
    return hw.with_megatron(knobs=knobs, kernels=own if own and own.gemm else flat_tables(hw, rate_dtype))

