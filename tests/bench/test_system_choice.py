"""System configs in paper folders (bench/system_choice.py): the layout, the name and policy a
yaml's path implies, the one-line error for an old flat name, the help listing by paper, and
every system's typed config against the snapshot taken before the move."""
from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
from importlib import resources

import pytest
import yaml

from bench.app import main
from bench.config import compose_config
from bench.system_choice import by_paper, choice_of, flat_choice_error
from bench.validate import _merge, system_class
from impl.common.errors import ConfigError
from tests.conftest import run_bench

ROOT = pathlib.Path(str(resources.files("conf"))) / "system"
YAMLS = sorted(ROOT.glob("*/*.yaml"))
SNAPSHOT = pathlib.Path(__file__).parent / "data" / "typed_system_configs.json"
PAPERS = {"adaptra", "caraserve", "ckpt_recovery", "fisedit", "hotspa", "hydraulis", "lobra", "malleus",
          "swiftdiffusion", "harness"}


def _raw(path: pathlib.Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def _base(path: pathlib.Path):
    entries = [e for e in _raw(path).get("defaults") or [] if e != "_self_"]
    return ROOT / f"{entries[0].removesuffix('@_here_')}.yaml" if entries else None


def test_conf_system_holds_paper_folders_only():
    flat = sorted(p.name for p in ROOT.iterdir() if p.is_file() and p.name != "__init__.py")
    assert not flat, f"flat system configs: {flat}"
    assert {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"} == PAPERS


def test_a_yaml_states_its_policy_only_where_it_differs_from_its_stem():
    assert YAMLS
    for path in YAMLS:
        raw = _raw(path)
        assert "name" not in raw, f"{path.parent.name}/{path.name}: the name is the file's stem"
        if "policy" in raw:
            assert raw["policy"] != path.stem, f"{path.parent.name}/{path.name}: policy repeats the stem"
        base = _base(path)
        # A base's policy would be inherited silently under another name: the variant would run
        # its parent's policy without saying so.
        assert base is None or "policy" not in _raw(base), f"{path.name} inherits {base.name}'s policy"


def test_name_and_policy_come_from_the_path_and_an_override_wins():
    cfg = compose_config(["system=caraserve/mostidle"])
    assert (cfg.system.name, cfg.system.policy) == ("mostidle", "caraserve")
    cfg = compose_config(["system=hydraulis/hydraulis_b0"])
    assert (cfg.system.name, cfg.system.policy) == ("hydraulis_b0", "hydraulis_b0")
    assert "policy" not in compose_config(["system=adaptra/zb"]).system  # PipelineTraining has no policy knob
    cfg = compose_config(["system=caraserve/slora", "system.name=mine", "system.policy=dlora"])
    assert (cfg.system.name, cfg.system.policy) == ("mine", "dlora")


def test_choice_of_finds_a_name_in_its_paper_folder():
    assert choice_of("hydraulis_b0") == "hydraulis/hydraulis_b0"
    assert choice_of("hotspa_like") == "hydraulis/hotspa_like"
    assert choice_of("calibrate") == "harness/calibrate"
    assert choice_of("malleus/uniform") == "malleus/uniform"
    assert choice_of("echo_a") == "echo_a"  # a test conf's own system: Hydra finds it there
    assert by_paper()["hotspa"][:2] == ["deepspeed_static", "hotspa"]
    assert sum(map(len, by_paper().values())) == len(YAMLS)


@pytest.mark.parametrize("overrides", [
    ["system=hydraulis_b0"],
    ["mode=sim", "system=malleus/uniform,hydraulis_b0"],
    ["system=choice(malleus/uniform,hydraulis_b0)"],
])
def test_an_old_flat_name_fails_in_one_line_naming_its_new_place(overrides, capsys):
    want = "system=hydraulis_b0: system configs live in paper folders now; use system=hydraulis/hydraulis_b0"
    assert flat_choice_error(overrides) == want
    with pytest.raises(ConfigError, match=f"^{want}$"):
        compose_config(overrides)
    with pytest.raises(SystemExit) as exc:
        main(["--multirun", *overrides] if "," in overrides[-1] else overrides)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"mlsys-bench: error: {want}"]


def test_flat_names_outside_a_system_choice_are_left_alone():
    assert flat_choice_error(["system.policy=hydraulis_b0", "baseline_system=zb", "system.real_system=zb"]) is None


def test_help_lists_systems_by_paper():
    proc = run_bench(["--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    groups = out[out.index("== Configuration groups =="):out.index("== Config ==")].splitlines()
    for paper, stems in by_paper().items():
        assert f"system/{paper}: {', '.join(stems)}" in groups, paper
    assert not [ln for ln in groups if ln.startswith("system:")], "a flat system list"
    assert "\nsystem:\n  _target_: impl.adaptra.system.PipelineTraining" in out  # the rest of Hydra's help


def _plain(o):
    if dataclasses.is_dataclass(o):
        return {f.name: _plain(getattr(o, f.name)) for f in dataclasses.fields(o)}
    if isinstance(o, enum.Enum):
        return o.value
    if isinstance(o, (list, tuple)):
        return [_plain(x) for x in o]
    if isinstance(o, dict):
        return {str(k): _plain(v) for k, v in o.items()}
    return o


@pytest.mark.parametrize("name", sorted(json.loads(SNAPSHOT.read_text())))
def test_every_system_types_as_in_the_snapshot(name):
    """Class, name and every knob of each system's typed config, composed through its folder, equal
    the snapshot (tests/bench/data/typed_system_configs.json). A change of a default or of a
    yaml shows here: update the snapshot in the same commit, on purpose."""
    want = json.loads(SNAPSHOT.read_text())[name]
    node = compose_config([f"system={choice_of(name)}"]).system
    cls = system_class(node)
    got = {"class": f"{cls.__module__}.{cls.__qualname__}", "name": node.get("name") or cls.__name__.lower(),
           "knobs": _plain(_merge("system", cls.Config, node, drop=("_target_", "name")))}
    assert json.loads(json.dumps(got)) == want
