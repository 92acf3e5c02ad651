"""experiment=hydraulis/hinges: every point types, changes exactly its declared key, and the
settings axis is the README presets' own (workload, profile) pairs (hydraulis/s1..s4)."""
from __future__ import annotations

import copy
import pathlib

import pytest
from omegaconf import OmegaConf, open_dict

from bench.config import compose_config
from bench.hinges import apply_point, points, typed
from bench.validate import typed_job

EXP = "hydraulis/hinges"
CONF = pathlib.Path(__file__).resolve().parents[2] / "conf" / "experiment" / "hydraulis"
SETTING_AXIS = "experiment/hydraulis/hinge_settings@_global_"


def _flat(cfg) -> dict:
    out = {}

    def walk(node, prefix):
        # Lists of mappings (a workload's tasks) open up; a list of values is one value.
        if isinstance(node, dict) or (isinstance(node, list) and node and all(isinstance(v, dict) for v in node)):
            for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def _changed(fa: dict, b) -> set:
    fb = _flat(b)
    return {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)} - {"hinges.point"}


@pytest.fixture(scope="module")
def composed():
    return {s: compose_config([f"experiment={EXP}", f"system={s}"]) for s in ("hydraulis", "megatron_like")}


def test_every_point_types_and_changes_only_its_key(composed):
    for system, base in composed.items():
        h = typed(base.hinges)
        assert h.claims == ["headline_band", "scenario_band"]
        flat = points(h)
        zero = copy.deepcopy(base)
        with open_dict(zero):
            zero.hinges.point = 0
        assert apply_point(zero, []) == []
        typed_job(zero)
        flat_zero = _flat(zero)
        for k in range(1, len(flat) + 1):
            cfg = copy.deepcopy(base)
            with open_dict(cfg):
                cfg.hinges.point = k
            overrides = apply_point(cfg, [])
            inp = h.inputs[flat[k - 1][0]]
            # Typing costs ~0.5 s a point: every point on the candidate, the baseline's own points on it.
            if system == "hydraulis" or inp.systems:
                assert typed_job(cfg).system_name == system
            if inp.systems and system not in inp.systems:
                assert overrides == [] and _changed(flat_zero, cfg) == set(), (k, inp.name)
                continue
            assert _changed(flat_zero, cfg) == {inp.key}, (k, inp.name)
            assert overrides == [f"{inp.key}={OmegaConf.select(cfg, inp.key)}"]
            j = flat[k - 1][1]
            want = inp.values[j] if inp.values else OmegaConf.select(zero, inp.key) * inp.factors[j]
            assert OmegaConf.select(cfg, inp.key) == pytest.approx(want, rel=1e-6, abs=0.5 if inp.key.endswith("token_budget") else 0)


def test_the_point_override_composes():
    h = typed(compose_config([f"experiment={EXP}"]).hinges)
    n = len(points(h))
    cfg = compose_config([f"experiment={EXP}", f"hinges.point={n}", "system=megatron_like", f"{SETTING_AXIS}=s4"])
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
