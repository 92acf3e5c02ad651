"""Run one job: type the config, seed, run the system, write the record (even on failure)."""
from __future__ import annotations

import pathlib
import random
import shutil
import tempfile
import time
import traceback
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


def execute(cfg: DictConfig, overrides: list[str], *, sweep: Optional[str] = None,
            choices: Optional[dict[str, str]] = None) -> dict:
    """Run the job described by ``cfg`` and return the record that was written.

    Under torchrun every rank runs the job (its system's ranks are this process); only the
    primary (global rank 0) writes: the others work in a scratch folder and write nothing."""
    started = time.perf_counter()
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

    result: Optional[RunResult] = None
    error: Optional[str] = None
    status = "failed"
    logger = None
    wandb_info = None
    probe: Optional[HostLoadProbe] = None
    host_load: Optional[dict] = None
    not_applicable = False
    invalid_reasons: list[str] = []
    error_log: Optional[pathlib.Path] = None
    error_frames: list[str] = []
    execution = Execution()
    take_notes()  # placements of an earlier job in this process are not this job's
    try:
        job = typed_job(cfg)
        execution = job.execution
        # A knob override does not rename the system (a global tweak like timeline=false would
        # otherwise break --baseline); name a variant with system.name=... instead.
        system_label = job.system_name
        mode = str(resolved["mode"])
        if str(cfg.logger.name) != "none" and primary:
            from bench.loggers import make_logger

            logger = make_logger(OmegaConf.to_object(cfg.logger), out_dir)
            logger.start(run_id=run_id, experiment=experiment, system=system_label, mode=mode,
                         hardware=_hardware_label(mode, choices["hardware"], execution_summary(execution, [])),
                         fault=choices["fault"],
                         workload=choices["workload"], config=resolved)
        seed_everything(int(cfg.seed))
        ctx = JobContext(mode=mode, seed=int(cfg.seed), experiment=experiment,
                         workload=job.workload, workload_name=choices["workload"], hardware=job.hardware,
                         hardware_name=choices["hardware"] or job.hardware.name, fault=job.fault,
                         fault_name=choices["fault"] or "none", out_dir=out_dir,
                         show_progress=bool(cfg.progress), execution=execution)
        set_current_execution(execution)
        if mode == "real":
            execution.apply_threads()
        # Real timings are judged by how busy the host was meanwhile; sim ones never are.
        # (a rank-0 estimate times nothing: no probe)
        probe = HostLoadProbe().start() if mode == "real" and execution.ranks != "estimate" else None
        with stdlib_start_method():  # a joblib worker's loky start method would kill the job's children
            result = job.system.run(ctx)
        host_load = probe.stop() if probe else None
        if not isinstance(result, RunResult):
            raise TypeError(f"system {system_label!r} returned {type(result).__name__}, not RunResult")
        status = result.status
        invalid_reasons = list(result.invalid_reasons)
        contended = contention_reason(host_load, cfg.validity.max_foreign_cpu_frac) if host_load else None
        if contended and status != "failed":
            status = "invalid"
            invalid_reasons.append(contended)
    except Exception as exc:  # the record must say why; the multirun goes on
        # The system's preflight refused the situation: the record says so, a cross table shows it.
        not_applicable = isinstance(exc, NotApplicable)
        if probe is not None and host_load is None:
            host_load = probe.stop()
        error = one_line(exc)
        tb = traceback.format_exc()
        error_log = out_dir / "error.log"
        error_log.write_text(tb)
        error_frames = _traceback_tail(exc)
    finally:
        set_current_execution(None)
        if logger is not None:
            try:
                if result is not None:
                    logger.log_result({k: m.to_dict() for k, m in result.metrics.items()},
                                      [out_dir / a for a in result.artifacts], status)
                wandb_info = logger.finish()
            except Exception as exc:  # logging is for browsing; never lose the record over it
                (out_dir / "logger-error.log").write_text(traceback.format_exc())
                wandb_info = {"mode": "error", "run_id": None, "dir": None, "error": one_line(exc)}

    mode_s = str(resolved["mode"])
    where = execution_summary(execution, take_notes()) if mode_s == "real" else None
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
        "run_id": run_id,
        "created": now_iso(),
        "status": status,
        "error": error,
        "invalid_reasons": invalid_reasons,
        "experiment": experiment,
        "system": system_label,
        "mode": str(resolved["mode"]),
        "workload": choices["workload"],
        "hardware": _hardware_label(mode_s, choices["hardware"], where),
        "fault": choices["fault"] or "none",
        "seed": int(cfg.seed),
        "metrics": {k: m.to_dict() for k, m in (result.metrics.items() if result else [])},
        "provenance": provenance.collect(result.emulated if result else [], _sim_fidelity(cfg, resolved, result)),
        "config": resolved,
        "overrides": list(overrides),
        "wandb": wandb_info,
        "info": info,
        "artifacts": list(result.artifacts) if result else [],
        "duration_s": round(time.perf_counter() - started, 3),
    }
    if error is not None and not_applicable:
        record["not_applicable"] = True
    if error_log is not None and not not_applicable:
        # the console prints the path; the record keeps where it failed
        record["error_log"] = str(error_log) if primary else None
        record["error_frames"] = error_frames
    if host_load is not None:
        record["host_load"] = host_load
    if sweep:
        record["sweep"] = sweep
    if not primary:
        shutil.rmtree(out_dir, ignore_errors=True)
        return record
    try:
        write_record(results_dir, record)
    except ValueError as exc:  # e.g. a NaN metric: keep the run visible as failed, never drop it
        record.update(status="failed", error=f"record rejected: {one_line(exc)}", metrics={})
        write_record(results_dir, record)
    _store_fidelity(cfg, record)
    return record


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
