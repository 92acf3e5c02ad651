"""Structured configs: the typed top level, registered in Hydra's ConfigStore.

Group nodes that differ per family (system knobs, workload kind, fault kind) are typed by a
second step, :func:`bench.validate.typed_job`, which merges each into the dataclass its yaml
names, so that an unknown key or a wrong type fails before any work.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import open_dict

from bench.hinges import HingesConfig
from bench.system_choice import apply_hydra_choice, flat_choice_error, identity_overrides
from impl.common.errors import ConfigError
from impl.common.execution import ExecutionConfig


class Mode(str, enum.Enum):
    sim = "sim"
    real = "real"


class Launcher(str, enum.Enum):
    local = "local"
    docker = "docker"


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb
    project: str = "mlsys-bench"
    entity: Optional[str] = None
    # offline by default so that runs need no network; WANDB_MODE in the environment wins.
    mode: str = "offline"
    dir: Optional[str] = None


@dataclass
class ValidityConfig:
    """Rules that make a finished real run ``status: invalid`` (it then feeds no comparison
    and no gate). Sim runs do not depend on the host and are never judged by these."""

    # Largest share of the host's CPU time (all cores, over the run) that processes outside
    # the job may take; null turns the check off. See bench.host_load.
    max_foreign_cpu_frac: Optional[float] = 0.25


@dataclass
class BenchConfig:
    system: Any = None
    workload: Any = None
    hardware: Any = None
    fault: Any = None
    # Where real work runs: device, dtype, threads, backend (conf/execution/; impl.common.execution).
    execution: Any = None
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    validity: ValidityConfig = field(default_factory=ValidityConfig)
    # Label for records; defaults to the chosen experiment preset (experiment=...), else "adhoc".
    experiment_name: Optional[str] = None
    # "module:function" drawing the experiment's own figure from the sweep's records (called
    # with (records, out_dir) when a multirun ends), e.g. a delay sweep as lines like the paper's.
    figure: Optional[str] = None
    # Baseline for the table printed when a multirun ends (default: compare's rule).
    baseline_system: Optional[str] = None
    # A job whose system refuses it in preflight (impl.common.api.NotApplicable) is recorded as
    # not applicable and the sweep goes on, instead of the command stopping before any work
    # (the cross-paper presets, conf/experiment/cross/, set it).
    not_applicable_ok: bool = False
    # A hinge experiment's declared inputs and this job's point (bench.hinges; typed there).
    hinges: Optional[HingesConfig] = None
    mode: Mode = Mode.sim
    seed: int = 0
    results_dir: str = "results/runs"
    # Each family's latest sim-vs-real error per host (bench.fidelity.store); null =
    # <results_dir>/fidelity.json. Fidelity jobs write it; every sim record's provenance reads it.
    fidelity_store: Optional[str] = None
    launcher: Launcher = Launcher.local
    container_image: str = "mlsys-bench:cpu"
    progress: bool = True


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="bench_schema", node=BenchConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)


def compose_config(overrides, *, return_hydra_config: bool = False):
    """The job config the CLI would build from ``overrides`` (Hydra's compose API, this
    project's ``conf`` package), without running Hydra's app: for in-process jobs and tests.
    The system node gets its name and policy from the chosen yaml, as in the app."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    overrides = identity_overrides(overrides)
    flat = flat_choice_error(overrides)
    if flat:
        raise ConfigError(flat)
    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            # The hydra node holds the choice (system=<paper>/<stem>), so it is composed always.
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    apply_hydra_choice(cfg)
    if not return_hydra_config:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg
