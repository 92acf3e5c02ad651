"""Run one job: type the config, seed, run the system, write the record (even on failure)."""
from __future__ import annotations

import pathlib
import random
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from omegaconf import DictConfig, OmegaConf

from bench import provenance
from bench.hinges import apply_point
from bench.host_load import HostLoadProbe, contention_reason
from bench.record import SCHEMA_ID, new_run_id, now_iso, write_record
from bench.validate import typed_job
from impl.common.api import JobContext, NotApplicable, RunResult
from impl.common.errors import one_line
from impl.common.execution import Execution, hardware_label as execution_hardware_label, summarize as execution_summary
from impl.common.execution import set_current as set_current_execution, take_notes
from impl.common.runtime.launch import is_primary, stdlib_start_method


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _choice(cfg: DictConfig, group: str) -> str:
    """Name of the yaml chosen for a group (from Hydra's runtime choices when available)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.choices.get(group) or "")
    except Exception:
        return ""


def _label(group: str, choice: str, overrides: list[str]) -> str:
    """The group's yaml name plus any value overridden on the command line or by a sweep, so
    that records of a sweep over e.g. ``fault.delay_s`` never fall into one comparison group."""
    tweaks = sorted(o.lstrip("+~")[len(group) + 1:] for o in overrides if o.lstrip("+~").startswith(group + "."))
    return f"{choice}[{','.join(tweaks)}]" if tweaks else choice


def _hardware_label(mode: str, profile: str, where: Optional[dict] = None) -> str:
    """Real runs ran on this host, whatever profile was composed (it only feeds emulated pieces,
    kept in the config), on the device the job's placements name; sim runs are labelled with
    the profile they priced."""
    if mode != "real":
        return profile
    if where is None:
        where = execution_summary(Execution(), [])
    return execution_hardware_label(where)


TRACEBACK_FRAMES = 6


def _traceback_tail(exc: BaseException) -> list[str]:
    """The last frames of ``exc``'s traceback as ``file:line in func``, innermost last."""
    frames = traceback.extract_tb(exc.__traceback__)[-TRACEBACK_FRAMES:]
    return [f"{_short_path(f.filename)}:{f.lineno} in {f.name}" for f in frames]


def _short_path(path: str) -> str:
    """Paths inside the repository relative to it; others (site-packages) from the package on."""
    p = pathlib.Path(path)
    try:
        return str(p.resolve().relative_to(_REPO))
    except (ValueError, OSError):
        parts = p.parts
        for marker in ("site-packages", "dist-packages"):
            if marker in parts:
                return "/".join(parts[parts.index(marker) + 1:])
        return path


_REPO = pathlib.Path(__file__).resolve().parent.parent


@dataclass
class _Job:
    """What a job is called and where it writes, fixed before anything of it runs."""

    experiment: str
    overrides: list[str]
    choices: dict[str, str]
    system_label: str  # from the composed config; typing the job may name it better
    run_id: str
    results_dir: pathlib.Path
    out_dir: pathlib.Path
    resolved: dict
    mode: str
    primary: bool


@dataclass
class _Outcome:
    """What running the job left: its result or why it has none, and what watched it."""

    system_label: str
    execution: Execution = field(default_factory=Execution)
    result: Any = None  # a RunResult, unless the system broke its contract
    status: str = "failed"
    error: Optional[str] = None
    not_applicable: bool = False
    invalid_reasons: list[str] = field(default_factory=list)
    host_load: Optional[dict] = None
    error_log: Optional[pathlib.Path] = None
    error_frames: list[str] = field(default_factory=list)
    wandb_info: Optional[dict] = None


def execute(cfg: DictConfig, overrides: list[str], *, sweep: Optional[str] = None,
            choices: Optional[dict[str, str]] = None) -> dict:
    """Run the job described by ``cfg`` and return the record that was written.

    Under torchrun every rank runs the job (its system's ranks are this process); only the
    primary (global rank 0) writes: the others work in a scratch folder and write nothing."""
    started = time.perf_counter()
    job = _name_job(cfg, overrides, choices)
    outcome = _run(cfg, job)
    record = _record(cfg, job, outcome, sweep, started)
    if not job.primary:
        shutil.rmtree(job.out_dir, ignore_errors=True)
        return record
    _write(job.results_dir, record)
    _store_fidelity(cfg, record)
    return record


def _name_job(cfg: DictConfig, overrides: list[str], choices: Optional[dict[str, str]]) -> _Job:
    """Labels (each group's yaml plus its overridden values), run id and output folder."""
    primary = is_primary()
    choices = dict(choices or {})
    for group in ("system", "workload", "hardware", "fault", "experiment"):
        choices.setdefault(group, _choice(cfg, group))
    experiment = provenance.redact(str(cfg.get("experiment_name") or choices["experiment"] or "adhoc"))
    # A hinge job's point is one more override: its value lands in the labels like a sweep's.
    overrides = provenance.redact(apply_point(cfg, list(overrides)))
    for group in ("workload", "hardware", "fault"):
        choices[group] = _label(group, choices[group] or ("none" if group == "fault" else ""), overrides)
    system_label = str(cfg.system.get("name") or choices["system"] or "unknown")
    run_id = new_run_id(system_label)
    results_dir = pathlib.Path(cfg.results_dir)
    out_dir = results_dir / run_id if primary else pathlib.Path(tempfile.mkdtemp(prefix="mlsys-bench-rank-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved = provenance.redact(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    return _Job(experiment, overrides, choices, system_label, run_id, results_dir, out_dir, resolved,
                str(resolved["mode"]), primary)


def _run(cfg: DictConfig, job: _Job) -> _Outcome:
    """Type the job, run its system, judge the result; any failure becomes the outcome's error."""
    out = _Outcome(job.system_label)
    logger = None
    probe: Optional[HostLoadProbe] = None
    take_notes()  # placements of an earlier job in this process are not this job's
    try:
        typed = typed_job(cfg)
        out.execution = typed.execution
        # A knob override does not rename the system (a global tweak like timeline=false would
        # otherwise break --baseline); name a variant with system.name=... instead.
        out.system_label = typed.system_name
        logger = _start_logger(cfg, job, out)
        seed_everything(int(cfg.seed))
        ctx = _context(cfg, job, typed)
        set_current_execution(out.execution)
        if job.mode == "real":
            out.execution.apply_threads()
        # Real timings are judged by how busy the host was meanwhile; sim ones never are.
        # (a rank-0 estimate times nothing: no probe)
        probe = HostLoadProbe().start() if job.mode == "real" and out.execution.ranks != "estimate" else None
        with stdlib_start_method():  # a joblib worker's loky start method would kill the job's children
            out.result = typed.system.run(ctx)
        out.host_load = probe.stop() if probe else None
        _judge(cfg, out)
    except Exception as exc:  # the record must say why; the multirun goes on
        if probe is not None and out.host_load is None:
            out.host_load = probe.stop()
        _note_failure(out, exc, job.out_dir)
    finally:
        set_current_execution(None)
        if logger is not None:
            out.wandb_info = _finish_logger(logger, out, job.out_dir)
    return out


def _start_logger(cfg: DictConfig, job: _Job, out: _Outcome):
    """The run's browsing logger (the primary's only), started; None when the config has none."""
    if str(cfg.logger.name) == "none" or not job.primary:
        return None
    from bench.loggers import make_logger

    logger = make_logger(OmegaConf.to_object(cfg.logger), job.out_dir)
    logger.start(run_id=job.run_id, experiment=job.experiment, system=out.system_label, mode=job.mode,
                 hardware=_hardware_label(job.mode, job.choices["hardware"], execution_summary(out.execution, [])),
                 fault=job.choices["fault"],
                 workload=job.choices["workload"], config=job.resolved)
    return logger


def _context(cfg: DictConfig, job: _Job, typed) -> JobContext:
    return JobContext(mode=job.mode, seed=int(cfg.seed), experiment=job.experiment,
                      workload=typed.workload, workload_name=job.choices["workload"], hardware=typed.hardware,
                      hardware_name=job.choices["hardware"] or typed.hardware.name, fault=typed.fault,
                      fault_name=job.choices["fault"] or "none", out_dir=job.out_dir,
                      show_progress=bool(cfg.progress), execution=typed.execution)


def _judge(cfg: DictConfig, out: _Outcome) -> None:
    """The system's own verdict, made invalid when the host was contended meanwhile."""
    if not isinstance(out.result, RunResult):
        raise TypeError(f"system {out.system_label!r} returned {type(out.result).__name__}, not RunResult")
    out.status = out.result.status
    out.invalid_reasons = list(out.result.invalid_reasons)
    contended = contention_reason(out.host_load, cfg.validity.max_foreign_cpu_frac) if out.host_load else None
    if contended and out.status != "failed":
        out.status = "invalid"
        out.invalid_reasons.append(contended)


def _note_failure(out: _Outcome, exc: Exception, out_dir: pathlib.Path) -> None:
    # The system's preflight refused the situation: the record says so, a cross table shows it.
    out.not_applicable = isinstance(exc, NotApplicable)
    out.error = one_line(exc)
    out.error_log = out_dir / "error.log"
    out.error_log.write_text(traceback.format_exc())
    out.error_frames = _traceback_tail(exc)


def _finish_logger(logger, out: _Outcome, out_dir: pathlib.Path) -> dict:
    try:
        if out.result is not None:
            logger.log_result({k: m.to_dict() for k, m in out.result.metrics.items()},
                              [out_dir / a for a in out.result.artifacts], out.status)
        return logger.finish()
    except Exception as exc:  # logging is for browsing; never lose the record over it
        (out_dir / "logger-error.log").write_text(traceback.format_exc())
        return {"mode": "error", "run_id": None, "dir": None, "error": one_line(exc)}


def _record(cfg: DictConfig, job: _Job, out: _Outcome, sweep: Optional[str], started: float) -> dict[str, Any]:
    result = out.result
    where = execution_summary(out.execution, take_notes()) if job.mode == "real" else None
    info = provenance.redact(result.info) if result else {}
    if where is not None:
        info = dict(info)
        info["execution"] = where
        # What the job itself reports wins (a system may place part of its work elsewhere);
        # otherwise the placements say where it ran.
        info.setdefault("device", where["device"])
        info.setdefault("backend", where["backend"])
    record: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "run_id": job.run_id,
        "created": now_iso(),
        "status": out.status,
        "error": out.error,
        "invalid_reasons": out.invalid_reasons,
        "experiment": job.experiment,
        "system": out.system_label,
        "mode": job.mode,
        "workload": job.choices["workload"],
        "hardware": _hardware_label(job.mode, job.choices["hardware"], where),
        "fault": job.choices["fault"] or "none",
        "seed": int(cfg.seed),
        "metrics": {k: m.to_dict() for k, m in (result.metrics.items() if result else [])},
        "provenance": provenance.collect(result.emulated if result else [], _sim_fidelity(cfg, job.resolved, result)),
        "config": job.resolved,
        "overrides": list(job.overrides),
        "wandb": out.wandb_info,
        "info": info,
        "artifacts": list(result.artifacts) if result else [],
        "duration_s": round(time.perf_counter() - started, 3),
    }
    if out.error is not None and out.not_applicable:
        record["not_applicable"] = True
    if out.error_log is not None and not out.not_applicable:
        # the console prints the path; the record keeps where it failed
        record["error_log"] = str(out.error_log) if job.primary else None
        record["error_frames"] = out.error_frames
    if out.host_load is not None:
        record["host_load"] = out.host_load
    if sweep:
        record["sweep"] = sweep
    return record


def _write(results_dir: pathlib.Path, record: dict) -> None:
    try:
        write_record(results_dir, record)
    except ValueError as exc:  # e.g. a NaN metric: keep the run visible as failed, never drop it
        record.update(status="failed", error=f"record rejected: {one_line(exc)}", metrics={})
        write_record(results_dir, record)


def _fidelity_store(cfg: DictConfig):
    from bench.fidelity.store import store_path

    return store_path(cfg.get("fidelity_store"), cfg.results_dir)


def _sim_fidelity(cfg: DictConfig, resolved: dict, result=None) -> Optional[dict]:
    """A sim record's family fidelity (None for real records: they are the measurement); a
    record priced through the Megatron step model (``info.megatron_step_model``) also names the
    paper-scale family of its profile."""
    if str(resolved.get("mode")) != "sim":
        return None
    from bench.fidelity.families import family_of
    from bench.fidelity.store import provenance_entry

    entry = provenance_entry(_fidelity_store(cfg), family_of((resolved.get("workload") or {}).get("kind")))
    paper = paper_scale_entry(resolved.get("hardware") or {})
    if paper and result is not None and (result.info or {}).get("megatron_step_model"):
        entry["paper_scale"] = paper
    return entry


PAPER_SCALE_FAMILY = "paper scale (H100 Megatron)"


def paper_scale_entry(hardware: dict) -> Optional[dict]:
    """For a profile with Megatron knobs: the paper-scale family's cross-validated error against
    the measured H100 launches it was fitted on (or the profile it was derived from)."""
    cal = dict(hardware.get("calibration") or {})
    if not (hardware.get("megatron") or {}).get("knobs") or not cal:
        return None
    derived = cal.get("derived_from")
    base = cal.get("base_calibration") or {} if derived else cal
    cv = base.get("cross_validated") or {}
    return {"family": PAPER_SCALE_FAMILY, "profile": hardware.get("name"), "derived_from": derived,
            "runs_file": base.get("runs_file"), "runs_sha256": base.get("runs_sha256"),
            "cross_validated": {k: cv[k] for k in ("folds", "pad_time", "pack_time", "memory", "verdict") if k in cv}}


def _store_fidelity(cfg: DictConfig, record: dict) -> None:
    """A valid fidelity record (host check included) becomes its family's latest measurement;
    an invalid one never does: a contended host's sim-vs-real error is meaningless."""
    fid = (record.get("info") or {}).get("fidelity")
    if record["status"] != "ok" or not fid:
        return
    from bench.fidelity.store import situation_key, update

    update(_fidelity_store(cfg), fid["family"], situation_key(fid["situation"], record["workload"], record["fault"]),
           {"run_id": record["run_id"], "date": record["created"], "rows": fid["rows"],
            "experiment": record["experiment"], "workload": record["workload"], "fault": record["fault"]})
