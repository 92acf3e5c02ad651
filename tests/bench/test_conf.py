"""Every shipped config composes and types: systems, workloads, faults, experiments with their
sweeps, the default plan. Config rot fails here rather than in a user's sweep."""
from __future__ import annotations

import itertools
import pathlib
from importlib import resources

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import open_dict

from bench.app import preflight
from bench.config import register
from bench.default_plan import load_plan
from bench.system_choice import apply_hydra_choice
from bench.validate import typed_fault, typed_job, typed_system
from impl.common.api import NotApplicable

CONF = resources.files("conf")


def _names(group: str) -> list[str]:
    root = CONF.joinpath(group)
    out = []
    for path in sorted(pathlib_walk(root)):
        out.append(path)
    return out


def pathlib_walk(root, prefix=""):
    for entry in root.iterdir():
        if entry.is_dir():
            yield from pathlib_walk(entry, f"{prefix}{entry.name}/")
        elif entry.name.endswith(".yaml"):
            yield f"{prefix}{entry.name[:-5]}"


@pytest.fixture(scope="module")
def composer():
    register()
    GlobalHydra.instance().clear()
    def compose_job(overrides, hydra=False):
        # as bench.config.compose_config, in one Hydra context for the whole module
        cfg = apply_hydra_choice(compose(config_name="config", overrides=overrides, return_hydra_config=True))
        if not hydra:
            with open_dict(cfg):
                del cfg["hydra"]
        return cfg

    with initialize_config_module(config_module="conf", version_base="1.3"):
        yield compose_job
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("system", [n for n in _names("system")])
def test_every_system_types(composer, system):
    sys_obj, name = typed_system(composer([f"system={system}"]).system)
    assert name == system.split("/")[-1] and set(sys_obj.modes) <= {"sim", "real"}


@pytest.mark.parametrize("fault", _names("fault"))
def test_every_fault_types(composer, fault):
    # The fault spec alone; which systems and workloads accept it is each system's check.
    assert typed_fault(composer([f"fault={fault}"]).fault).kind


@pytest.mark.parametrize("hardware", [n for n in _names("hardware") if n != "local"])
def test_every_hardware_types(composer, hardware):
    assert typed_job(composer([f"hardware={hardware}", "system=adaptra/zb"])).hardware.peak_flops


@pytest.mark.parametrize("experiment", _names("experiment"))
def test_every_experiment_and_its_sweep_types(composer, experiment):
    cfg = composer([f"experiment={experiment}"], hydra=True)
    params = dict(cfg.hydra.sweeper.params or {})
    axes = []
    for key, values in params.items():
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())  # glob(*) sweeps
        ov = parser.parse_overrides([f"{key}={values}"])[0]
        vals = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [str(values)]
        axes.append([f"{key}={v}" for v in vals])
    combos = list(itertools.product(*axes)) or [()]
    # Every value of every axis appears in some checked combination, without the full product.
    picked = {tuple(axis[i % len(axis)] for axis in axes) for i in range(max(map(len, axes), default=1))}
    # gpu/* and gpu8/* presets ask for CUDA (gpu8: 8 GPUs); without them they are refused in preflight
    # (tests/common/test_execution.py), and here they are typed on the CPU.
    on_cpu = (["execution=cpu"] if experiment.startswith(("gpu/", "gpu8/")) and not torch.cuda.is_available()
              else [])
    if experiment == "gpu8/lobra" and on_cpu:
        # LobRA's real mode runs two replicas, not eight GPUs: on a CPU host its rank 0 is estimated.
        on_cpu = ["execution=estimate"]
    for combo in sorted(picked) if axes else combos:
        cfg = composer([f"experiment={experiment}", *combo, *on_cpu])
        try:
            job = typed_job(cfg)
        except NotApplicable:  # a cross-paper preset: its system refuses this situation in one line
            assert cfg.not_applicable_ok, combo
            continue
        assert job.system_name and job.workload.kind


def test_default_plan_steps_pass_preflight():
    plan = load_plan()
    assert plan.steps, "the default plan must run something"
    for step in plan.steps:
        assert preflight(list(step.args)) is None, step.title


def test_conf_holds_only_what_hydra_composes():
    """conf/ is Hydra's config groups (and their READMEs); data the harness reads itself lives with
    its reader (bench/data/, impl/<system>/data/, impl/common/megatron/data/)."""
    root = pathlib.Path(str(CONF))
    groups = {"system", "workload", "hardware", "fault", "experiment", "execution", "logger", "smoke", "hydra"}
    top = {p.name for p in root.iterdir() if p.name != "__pycache__"}
    assert top - groups - {"config.yaml", "__init__.py"} == set(), sorted(top - groups)
    stray = [str(p.relative_to(root)) for p in root.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".yaml"
             and p.name not in ("__init__.py", "README.md")]
    assert not stray, f"not Hydra configs: {stray}"


def test_every_system_variant_inherits_its_papers_base():
    """One base per system class; every other config of that class states ``defaults: [<base>]``
    (one level) and then what differs."""
    import collections

    import yaml

    from bench.config import compose_config

    def composer(overrides):
        return compose_config(overrides)

    root = pathlib.Path(str(CONF)) / "system"
    bases = collections.defaultdict(list)
    for path in sorted(root.glob("*/*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        choice = f"{path.parent.name}/{path.stem}"
        target = composer([f"system={choice}"]).system.get("_target_")
        if "defaults" not in raw:
            bases[target].append(path.stem)
            continue
        base = raw["defaults"][0].removesuffix("@_here_")
        assert base.split("/")[0] == path.parent.name, f"{choice}: its base {base} is another paper's"
        base_raw = yaml.safe_load((root / f"{base}.yaml").read_text())
        assert "defaults" not in base_raw, f"{choice}: its base {base} inherits too"
        assert composer([f"system={base}"]).system.get("_target_") == target, choice
    several = {t: b for t, b in bases.items() if len(b) > 1}
    assert not several, f"configs of one system class that do not inherit: {several}"


@pytest.mark.parametrize("override,choices", [
    ("system=lobra/lobra system.planner=x", "prune, group, balance"),
    ("system=lobra/lobra system.dispatch=x", "balanced, length, even"),
    ("system=hydraulis/hydraulis system.ilp_scope=x", "critical, all"),
    ("system=fisedit/fisedit system.schedule=x", "supplied, online"),
    ("system=swiftdiffusion/swiftdiffusion system.aggregation=x", "sum, katz_mean"),
    ("system=ckpt_recovery/ckpt_recovery +system.real.scenario=x", "recovery, one_gpu"),
])
def test_a_choice_outside_its_enum_is_one_line_naming_the_field(override, choices):
    # choices are typed (enum.StrEnum) in the structured configs, so a typo fails when
    # the config is typed, before any work, naming the field and the allowed values
    from bench.config import compose_config
    from impl.common.api import ConfigError

    field = override.split()[1].split("=")[0].lstrip("+")
    with pytest.raises(ConfigError) as e:
        typed_system(compose_config(override.split()).system)
    msg = str(e.value)
    assert msg.startswith(f"{field}: Invalid value 'x'") and choices in msg and "\n" not in msg, msg
