"""experiment=hydraulis/hinges: every point types, changes exactly its declared key, and the
settings axis is the README presets' own (workload, profile) pairs (hydraulis/s1..s4)."""
from __future__ import annotations

import pathlib

from omegaconf import OmegaConf

from bench.config import compose_config
from bench.hinges import apply_point, points, typed
from bench.validate import typed_job
from tests.support.hinge_points import check_points

EXP = "hydraulis/hinges"
CONF = pathlib.Path(__file__).resolve().parents[2] / "conf" / "experiment" / "hydraulis"
SETTING_AXIS = "experiment/hydraulis/hinge_settings@_global_"


def test_every_point_types_and_changes_only_its_key():
    # an input restricted to the baseline runs on it (tests/support/hinge_points.py)
    assert typed(compose_config([f"experiment={EXP}"]).hinges).claims == ["headline_band", "scenario_band"]
    assert check_points(EXP, ["system=hydraulis/hydraulis"]) == len(points(typed(compose_config([f"experiment={EXP}"]).hinges)))


def test_the_point_override_composes():
    h = typed(compose_config([f"experiment={EXP}"]).hinges)
    n = len(points(h))
    cfg = compose_config([f"experiment={EXP}", f"hinges.point={n}", "system=hydraulis/megatron_like", f"{SETTING_AXIS}=s4"])
    assert apply_point(cfg, []) == [f"{h.inputs[-1].key}={h.inputs[-1].values[-1]}"]
    assert typed_job(cfg).hardware.name == "a100-40g-megatron"


def test_settings_are_the_readme_presets_pairs():
    """The hinge sweep's settings = every (workload, profile) the README's S1-S4 presets run."""
    def defaults(y):
        return {k.replace("override /", ""): v for d in y.get("defaults", []) for k, v in d.items()}

    presets = set()
    for s in ("s1", "s2", "s3", "s4"):
        y = OmegaConf.to_container(OmegaConf.load(CONF / f"{s}.yaml"))
        for w in str(y["hydra"]["sweeper"]["params"]["workload"]).split(","):
            presets.add((w, defaults(y)["hardware"]))
    hinges = OmegaConf.to_container(OmegaConf.load(CONF / "hinges.yaml"))
    swept = str(hinges["hydra"]["sweeper"]["params"][SETTING_AXIS]).split(",")
    ours = set()
    for name in swept:
        d = defaults(OmegaConf.to_container(OmegaConf.load(CONF / "hinge_settings" / f"{name}.yaml")))
        ours.add((d["workload"], d["hardware"]))
    assert len(ours) == len(swept) and ours == presets
    n = len(points(typed(hinges["hinges"])))
    assert hinges["hydra"]["sweeper"]["params"]["hinges.point"] == f"range(0,{n + 1})"
