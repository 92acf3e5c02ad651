"""Second typing step: each group node merged into the dataclass its yaml names.

Every failure is a :class:`ConfigError` whose one-line message names the field.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from impl.common.fault_model.spec import KINDS as FAULT_KINDS
from impl.common.api import ConfigError, NotApplicable, System
from impl.common.errors import first_line
from impl.common.execution import Execution, ExecutionConfig, RankScope, resolve as resolve_execution
from impl.common.hardware import HardwareProfile, refuse_flat_diffusion_keys, refuse_renamed_knobs
from impl.common.workloads import KINDS as WORKLOAD_KINDS, workload_class


def _merge(group: str, schema_cls: type, node: Any, drop: tuple[str, ...] = ()) -> Any:
    try:
        data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise ConfigError(f"{key or group}: {first_line(exc)}") from None
    for key in drop:
        data.pop(key, None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema_cls), data)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        msg = first_line(exc)
        where = f"{group}.{key}" if key else group
        raise ConfigError(f"{where}: {msg}") from None
    missing = [f.name for f in dataclasses.fields(schema_cls) if getattr(obj, f.name, None) == "???"]
    if missing:
        raise ConfigError(f"{group}.{missing[0]}: a value is required")
    return obj


def system_class(node: Any) -> type[System]:
    target = node.get("_target_") if node is not None else None
    if not target:
        raise ConfigError("system._target_: the system yaml must name its class")
    try:
        cls = get_class(target)
    except Exception as exc:  # hydra wraps import errors; keep the cause in one line
        raise ConfigError(f"system._target_: cannot import {target!r} ({first_line(exc.__cause__ or exc)})") from None
    if not (isinstance(cls, type) and issubclass(cls, System)):
        raise ConfigError(f"system._target_: {target!r} is not a mlsys-bench System")
    return cls


def typed_system(node: Any) -> tuple[System, str]:
    cls = system_class(node)
    name = node.get("name") or cls.__name__.lower()
    knobs = _merge("system", cls.Config, node, drop=("_target_", "name"))
    return cls(knobs, name), name


def typed_workload(node: Any) -> Any:
    kind = (node or {}).get("kind")
    if kind is None:
        raise ConfigError(f"workload.kind: missing (one of: {', '.join(sorted(WORKLOAD_KINDS))})")
    try:
        cls = workload_class(kind)
    except KeyError:
        raise ConfigError(f"workload.kind: unknown kind {kind!r} (one of: {', '.join(sorted(WORKLOAD_KINDS))})") from None
    return _merge("workload", cls, node)


def typed_fault(node: Any) -> Any:
    kind = (node or {}).get("kind", "none")
    if kind not in FAULT_KINDS:
        raise ConfigError(f"fault.kind: unknown kind {kind!r} (one of: {', '.join(sorted(FAULT_KINDS))})")
    return _merge("fault", FAULT_KINDS[kind], node)


def typed_hardware(node: Any) -> HardwareProfile:
    """The hardware node as a profile. A ``megatron.knobs`` node that names only some knobs
    (an override such as ``+hardware.megatron.knobs.gemm_time_factor=1.1`` on a datasheet profile,
    whose knobs are null) sets those on top of the knobs the profile is priced with (carried from
    ``megatron.carried_from``), not on top of :class:`MegatronKnobs`' defaults."""
    from impl.common.hardware import MegatronKnobs
    from impl.common.megatron.derive import with_knob_overrides

    refuse_flat_diffusion_keys(node or {})
    refuse_renamed_knobs(node or {})
    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    knobs = (data.get("megatron") or {}).get("knobs")
    partial = isinstance(knobs, dict) and set(knobs) != {f.name for f in dataclasses.fields(MegatronKnobs)}
    if not partial:
        return _merge("hardware", HardwareProfile, data)
    data["megatron"]["knobs"] = None
    return with_knob_overrides(_merge("hardware", HardwareProfile, data), knobs)


def typed_execution(node: Any, mode: str = "real") -> Execution:
    """The job's device decision. A sim job prices a profile and runs nowhere in particular,
    so only a real job is refused for a device the host lacks."""
    cfg = _merge("execution", ExecutionConfig, node) if node is not None else ExecutionConfig()
    if mode != "real" and cfg.device == "cuda":
        cfg = dataclasses.replace(cfg, device="auto")
    return resolve_execution(cfg)


@dataclasses.dataclass
class TypedJob:
    system: System
    system_name: str
    workload: Any
    hardware: HardwareProfile
    fault: Any
    execution: Execution


def typed_job(cfg: DictConfig) -> TypedJob:
    bound = cfg.get("validity", {}).get("max_foreign_cpu_frac")
    if bound is not None and not 0 <= bound <= 1:
        raise ConfigError(f"validity.max_foreign_cpu_frac: must be in [0, 1] or null, got {bound}")
    system, name = typed_system(cfg.system)
    mode = str(cfg.mode.value if hasattr(cfg.mode, "value") else cfg.mode)
    if mode not in system.modes:
        raise ConfigError(f"mode: system {name!r} does not run in mode {mode!r} (supports: {', '.join(system.modes)})")
    execution = typed_execution(cfg.get("execution"), mode)
    job = TypedJob(system=system, system_name=name, workload=typed_workload(cfg.workload),
                   hardware=typed_hardware(cfg.hardware), fault=typed_fault(cfg.fault), execution=execution)
    try:
        if execution.ranks != RankScope.ALL:
            if mode != "real":
                raise ConfigError(f"execution.ranks: {execution.ranks} runs rank 0 of a real job (mode=real), "
                                  f"got mode={mode}")
            system.check_rank0(job.workload, job.hardware, job.fault)
        else:
            system.check(mode, job.workload, job.hardware, job.fault)
    except NotApplicable:
        raise
    except ConfigError as exc:
        raise NotApplicable(str(exc)) from None
    return job
