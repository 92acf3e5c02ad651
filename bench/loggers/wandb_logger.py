"""``logger=wandb``: one W&B run per job, offline unless the user asks otherwise.

group = experiment, job_type = system, tags = mode/hardware/fault (README.md, "Weights & Biases").
The W&B run id is the record's run_id, so an offline run folder
(``<dir>/wandb/offline-run-<time>-<run_id>``) is found from the record and vice versa.

A W&B failure after ``start`` never costs the job its record: ``log_result`` and ``finish``
warn on stderr and carry on, because the local record is the source of truth.
"""
from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

from bench.loggers.base import JobLogger, LoggerError
from impl.common.errors import one_line

MODES = ("online", "offline", "disabled")


def resolve_mode(cfg_mode: str | None) -> str:
    """WANDB_MODE in the environment wins over ``logger.mode`` (README.md, "Weights & Biases")."""
    env = os.environ.get("WANDB_MODE")
    mode = env or cfg_mode or "offline"
    if mode == "dryrun":  # the old spelling of offline, still accepted by wandb itself
        mode = "offline"
    if mode not in MODES:
        field = "WANDB_MODE" if env else "logger.mode"
        raise LoggerError(f"{field}: {mode!r} is not a W&B mode (expected one of {', '.join(MODES)})")
    return mode


def _settings(wandb: Any) -> Any:
    return wandb.Settings(
        silent=True,
        # No stdout/stderr capture: the job's console may print anything, and output.log
        # would copy it into the run folder.
        console="off",
        # A sampling thread would perturb the timings we measure; GPU/host probing and git
        # calls slow every job start. Host, devices and git are in the record's provenance.
        x_disable_stats=True,
        x_disable_machine_info=True,
        x_disable_meta=True,
        x_save_requirements=False,
        disable_git=True,
        save_code=False,
    )


class WandbLogger(JobLogger):
    def __init__(self, cfg: Any, out_dir: pathlib.Path):
        self.project = getattr(cfg, "project", None) or "mlsys-bench"
        self.entity = getattr(cfg, "entity", None)
        self.mode = resolve_mode(getattr(cfg, "mode", None))
        cfg_dir = getattr(cfg, "dir", None)
        self.dir = pathlib.Path(cfg_dir) if cfg_dir else pathlib.Path(out_dir)
        self.out_dir = pathlib.Path(out_dir)
        self._run: Any = None

    def start(self, *, run_id: str, experiment: str, system: str, mode: str, hardware: str,
              fault: str, workload: str, config: dict) -> None:
        import wandb

        if self.mode == "online" and not wandb.login(prompt=False, verify=False):
            # CI has no stdin: never let wandb fall back to an interactive login prompt.
            raise LoggerError("logger.mode: online needs W&B credentials (WANDB_API_KEY or "
                              "`wandb login`); use logger.mode=offline to log locally")
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=self.project,
                entity=self.entity,
                group=experiment,
                job_type=system,
                id=run_id,
                name=run_id,
                tags=[mode, hardware, fault],
                # Only what the runner passed (already redacted): never os.environ.
                # Group names as well, so the W&B UI can filter by workload (not a tag).
                config={**dict(config), "bench_job": {
                    "experiment": experiment, "system": system, "mode": mode,
                    "workload": workload, "hardware": hardware, "fault": fault}},
                dir=str(self.dir),
                mode=self.mode,
                # A multirun with the basic launcher runs jobs one after another in this
                # process: close whatever run a crashed job left open instead of reusing it.
                reinit="finish_previous",
                settings=_settings(wandb),
            )
        except LoggerError:
            raise
        except Exception as exc:  # wandb raises many types; the runner wants one line
            raise LoggerError(f"logger: wandb.init failed: {one_line(exc)}") from exc

    def log_result(self, metrics: dict[str, dict], artifacts: list[pathlib.Path],
                   status: str) -> None:
        if self._run is None:
            return
        try:
            self._log_result(metrics, artifacts, status)
        except Exception as exc:
            _warn(f"logging results to W&B failed: {one_line(exc)}")

    def _log_result(self, metrics: dict[str, dict], artifacts: list[pathlib.Path],
                    status: str) -> None:
        import wandb

        run = self._run
        summary: dict[str, Any] = {"status": status}
        units: dict[str, dict[str, Any]] = {}
        for name, m in metrics.items():
            summary[name] = m["value"]
            # The spread as sibling keys: W&B tables and panels can sort/plot them directly.
            for q in ("p10", "p90"):
                if m.get(q) is not None:
                    summary[f"{name}_{q}"] = m[q]
            summary[f"{name}_n"] = m.get("n", 1)
            units[name] = {"unit": m.get("unit"), "better": m.get("better")}
        run.summary.update(summary)
        # Units and direction as a config table, so summary keys stay plain metric names.
        run.config.update({"metric_units": units}, allow_val_change=True)
        images = {}
        for path in artifacts:
            path = pathlib.Path(path)
            if not path.is_absolute():
                path = self.out_dir / path
            if path.suffix.lower() == ".png" and path.is_file():
                images[f"plots/{path.stem}"] = wandb.Image(str(path))
        if images:
            run.log(images)

    def finish(self) -> dict | None:
        run, self._run = self._run, None
        if run is None:
            return None
        run_id = run_dir = None
        if self.mode != "disabled":
            run_id = run.id
            run_dir = str(pathlib.Path(run.settings.sync_dir).resolve())
        try:
            run.finish()
        except Exception as exc:
            _warn(f"closing the W&B run failed: {one_line(exc)}")
        return {"mode": self.mode, "run_id": run_id, "dir": run_dir}


def _warn(msg: str) -> None:
    print(f"mlsys-bench: warning: {msg}", file=sys.stderr)


def log_report_artifact(site_dir: pathlib.Path | str, *, mode: str | None = None, project: str | None = None,
                        entity: str | None = None, directory: str | None = None) -> dict:
    """Log a built report site (``mlsys-bench-report``) as one W&B artifact of type ``report``,
    in a run of its own (job_type ``report``). Offline unless ``mode``/WANDB_MODE say otherwise;
    returns ``{"mode", "run_id", "dir"}`` like a job's ``wandb`` field."""
    import wandb

    site_dir = pathlib.Path(site_dir)
    mode = resolve_mode(mode)
    if mode == "online" and not wandb.login(prompt=False, verify=False):
        raise LoggerError("logger.mode: online needs W&B credentials (WANDB_API_KEY or `wandb login`); "
                          "use logger.mode=offline to log locally")
    root = pathlib.Path(directory) if directory else site_dir
    root.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=project or "mlsys-bench", entity=entity, job_type="report", dir=str(root),
                     mode=mode, reinit="finish_previous", settings=_settings(wandb))
    try:
        art = wandb.Artifact("mlsys-bench-report", type="report",
                             description="static HTML report: every record beside each paper's numbers")
        for path in sorted(site_dir.rglob("*")):
            # The run's own folder may sit inside the site (dir defaults to it): never log it.
            if path.is_file() and "wandb" not in path.relative_to(site_dir).parts:
                art.add_file(str(path), name=path.relative_to(site_dir).as_posix())
        run.log_artifact(art)
        run_id = run.id if mode != "disabled" else None
        run_dir = str(pathlib.Path(run.settings.sync_dir).resolve()) if mode != "disabled" else None
    finally:
        run.finish()
    return {"mode": mode, "run_id": run_id, "dir": run_dir}
