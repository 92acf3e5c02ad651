"""Compose a job with Hydra's compose API and run its system in this process (fast tests)."""
from __future__ import annotations

import pathlib

from omegaconf import OmegaConf

from bench.config import compose_config
from bench.validate import typed_job
from impl.common.api import JobContext, RunResult


def run_job(overrides: list[str], out_dir: pathlib.Path) -> RunResult:
    cfg = compose_config(overrides)
    job = typed_job(cfg)
    mode = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)["mode"]
    ctx = JobContext(mode=mode, seed=int(cfg.seed), experiment="test", workload=job.workload, workload_name="w",
                     hardware=job.hardware, hardware_name=job.hardware.name, fault=job.fault, fault_name="f",
                     out_dir=pathlib.Path(out_dir), show_progress=False)
    return job.system.run(ctx)
