"""``system=harness/fidelity``: run a system for real, then its simulator on exactly that workload.

The job (mode real) builds the named system from ``conf/system/<paper>/<real_system>.yaml``, runs it
on this job's workload and fault, takes from it only the family's per-op profile
(:mod:`bench.fidelity.families`), and runs ``sim_system`` in sim mode on the same workload with
that profile and the calibrated hardware profile (``sim_hardware``, default ``local``; measured
first with ``system=harness/calibrate`` when missing). The real run gets the same profile for any
piece it emulates (CaraServe's host-to-device copy), so both price one machine.

The record's metrics hold, per headline metric ``m``: ``real__m``, ``sim__m``,
``sim_over_real__m`` and ``error_pct__m`` (signed, (sim - real) / real); ``info.fidelity`` has
the same rows with family, situation and what the sim took from the real run. A valid record
updates the fidelity store (:mod:`bench.fidelity.store`), which every sim record's provenance
reads. It lives in ``bench/`` because it drives systems (the layering contract).
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import OmegaConf

from bench.fidelity.families import get_family
from impl.common.api import ConfigError, JobContext, Metric, RunResult, System
from bench.system_choice import choice_of
from impl.common.conf_files import load_group_file, system_identity

PACKAGE_CONF = pathlib.Path(__file__).resolve().parents[2] / "conf"


def _conf_file(group: str, name: str) -> pathlib.Path:
    """``./conf/<group>/<name>.yaml`` (where calibration writes) before the package's own; a
    system by its name, in its paper folder."""
    option = choice_of(name) if group == "system" else name
    for root in (pathlib.Path.cwd() / "conf", PACKAGE_CONF):
        path = root / group / f"{option}.yaml"
        if path.is_file():
            return path
    raise ConfigError(f"{group}={option}: no conf/{group}/{option}.yaml")


def _local_threads(name: str) -> int:
    """N of a ``local-t<N>`` profile name (calibrated with N torch threads); 0 for any other."""
    m = re.fullmatch(r"local-t(\d+)", name or "")
    return int(m.group(1)) if m else 0


def build_system(name: str, knobs: dict) -> System:
    from bench.validate import typed_system

    path = _conf_file("system", name)
    node = OmegaConf.merge(load_group_file(path, root=path.parent.parent), knobs or {})
    system_identity(node, path.stem)
    system, _ = typed_system(node)
    return system


@dataclass
class FidelityConfig:
    family: str = "pipeline"  # pipeline | hybrid | serving | diffusion
    situation: str = ""  # label of the row (default: the real system's name)
    real_system: str = "zb"
    sim_system: str = ""  # default: real_system
    # Knobs merged into both systems' yamls (e.g. interleave: [] so one policy runs per job).
    system_knobs: Dict[str, Any] = field(default_factory=dict)
    # Knobs for the sim side only (a modelled piece the real run does for itself, e.g. when
    # Malleus's plan takes effect); never a fitted constant.
    sim_knobs: Dict[str, Any] = field(default_factory=dict)
    # A conf/hardware name, or a path to a profile yaml (tests use a fixture). ``local`` is
    # calibrated with torch's default threads (every core), ``local-t<N>`` with N threads: the
    # profile for a run that pins workload.torch_threads=N (measured first when missing).
    sim_hardware: str = "local"
    calibrate_if_missing: bool = True


class Fidelity(System):
    Config = FidelityConfig
    modes = ("real",)

    def check(self, mode, workload, hardware, fault) -> None:
        fam = get_family(self.cfg.family)
        from bench.fidelity.families import family_of

        kind_family = family_of(getattr(workload, "kind", None))
        if kind_family != fam.name:
            raise ConfigError(f"system.family: {fam.name!r} does not price workload kind "
                              f"{getattr(workload, 'kind', None)!r} (family {kind_family!r})")
        for name in (self.cfg.real_system, self.cfg.sim_system or self.cfg.real_system):
            _conf_file("system", name)
        n = _local_threads(self.cfg.sim_hardware)
        wt = getattr(workload, "torch_threads", None)
        if n and wt and int(wt) != n:
            raise ConfigError(f"system.sim_hardware: {self.cfg.sim_hardware} is calibrated with {n} thread(s) but "
                              f"workload.torch_threads is {wt}; use local-t{wt}")

    # ---- hardware ---------------------------------------------------------------------------
    def sim_profile(self, job: JobContext):
        from bench.validate import typed_hardware

        name = self.cfg.sim_hardware
        path = pathlib.Path(name) if name.endswith((".yaml", ".yml")) else None
        if path is None:
            try:
                path = _conf_file("hardware", name)
            except ConfigError:
                if not (name == "local" or _local_threads(name)) or not self.cfg.calibrate_if_missing:
                    raise
                path = self._calibrate(job, name)
        if not path.is_file():
            raise ConfigError(f"system.sim_hardware: no profile at {path}")
        self.profile_path = path.resolve()  # which file priced the sim: a fresh pass must use its own
        return typed_hardware(OmegaConf.load(path)), (path.stem if path.parent.name == "hardware" else str(path))

    def _calibrate(self, job: JobContext, name: str = "local") -> pathlib.Path:
        knobs = {"threads": _local_threads(name), "output": f"conf/hardware/{name}.yaml"} if _local_threads(name) else {}
        cal = build_system("calibrate", knobs)
        res = cal.run(dataclasses.replace(job, out_dir=job.out_dir / "calibrate"))
        if res.status != "ok":
            raise ConfigError(f"system.sim_hardware: calibration failed ({'; '.join(res.invalid_reasons)})")
        return pathlib.Path(cal.cfg.output).resolve()

    # ---- the job ----------------------------------------------------------------------------
    def run(self, job: JobContext) -> RunResult:
        from bench.validate import typed_workload

        self.check(job.mode, job.workload, job.hardware, job.fault)
        fam = get_family(self.cfg.family)
        sim_name = self.cfg.sim_system or self.cfg.real_system
        hw, hw_name = self.sim_profile(job)
        fam.check_hw(hw, job.workload, hw_name)  # before the real run, not after it

        real_sys = build_system(self.cfg.real_system, self.cfg.system_knobs)
        real_sys.check("real", job.workload, hw, job.fault)
        (job.out_dir / "real").mkdir(parents=True, exist_ok=True)
        real = real_sys.run(dataclasses.replace(job, mode="real", hardware=hw, hardware_name=hw_name,
                                                out_dir=job.out_dir / "real"))

        prof = fam.profile(real, job.workload, hw)
        wl_node = OmegaConf.merge(OmegaConf.structured(job.workload), prof.workload)
        sim_wl = typed_workload(wl_node)
        sim_sys = build_system(sim_name, OmegaConf.merge(self.cfg.system_knobs, self.cfg.sim_knobs, prof.system))
        sim_sys.check("sim", sim_wl, hw, job.fault)
        (job.out_dir / "sim").mkdir(parents=True, exist_ok=True)
        sim = sim_sys.run(dataclasses.replace(job, mode="sim", workload=sim_wl, hardware=hw, hardware_name=hw_name,
                                              out_dir=job.out_dir / "sim"))

        metrics: dict[str, Metric] = {}
        rows = []
        for h in fam.headlines:
            rm = real.metrics.get(h.real_metric)
            if h.sim_from_info:
                sv = sim.info.get(h.sim_metric)
                sm = None if sv is None else Metric.scalar(float(sv), rm.unit if rm else "", rm.better if rm else "lower")
            else:
                sm = sim.metrics.get(h.sim_metric)
            if rm is None or sm is None:
                missing = h.real_metric if rm is None else h.sim_metric
                raise ConfigError(f"system.family: {fam.name} headline {missing!r} missing from the "
                                  f"{'real' if rm is None else 'sim'} run of {self.cfg.real_system if rm is None else sim_name}")
            ratio = sm.value / rm.value
            err = 100.0 * (ratio - 1.0)
            metrics[f"real__{h.label}"] = rm
            metrics[f"sim__{h.label}"] = Metric.scalar(sm.value, sm.unit, sm.better)
            metrics[f"sim_over_real__{h.label}"] = Metric.scalar(ratio, "x", "lower")
            metrics[f"error_pct__{h.label}"] = Metric.scalar(err, "%", "lower")
            rows.append({"metric": h.label, "real": rm.value, "sim": sm.value, "unit": rm.unit,
                         "sim_over_real": ratio, "error_pct": err,
                         "real_p10": rm.p10, "real_p90": rm.p90, "real_n": rm.n})
        res = RunResult(metrics=metrics, emulated=list(real.emulated), artifacts=[
            f"real/{a}" for a in real.artifacts] + [f"sim/{a}" for a in sim.artifacts])
        res.info = {"fidelity": {
            "family": fam.name, "situation": self.cfg.situation or self.cfg.real_system,
            "real_system": self.cfg.real_system, "sim_system": sim_name,
            "real_target": f"{type(real_sys).__module__}.{type(real_sys).__qualname__}", "sim_hardware": hw_name,
            "sim_hardware_source": getattr(hw, "source", ""), "sim_hardware_path": str(self.profile_path),
            "from_real_run": prof.sources,
            "rows": rows}, "real_info": real.info, "sim_info": sim.info}
        for why in real.invalid_reasons:
            res.mark_invalid(f"real run: {why}")
        for why in sim.invalid_reasons:
            res.mark_invalid(f"sim run: {why}")
        return res
