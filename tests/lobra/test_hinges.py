"""experiment=lobra/hinges: every point types, changes exactly its declared key, and its settings
are the README presets of the two claims (lobra/e2e_7b, lobra/e2e_32b) themselves, each under its
own experiment name with its own claim."""
from __future__ import annotations

import copy
import pathlib

import pytest
from omegaconf import OmegaConf, open_dict

from bench.config import compose_config
from bench.hinges import apply_point, points, typed
from bench.paper import load_paper, paper_dir
from bench.validate import typed_job

EXP = "lobra/hinges"
CONF = pathlib.Path(__file__).resolve().parents[2] / "conf" / "experiment" / "lobra"
SETTING_AXIS = "experiment/lobra/hinge_settings@_global_"


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
    return {s: compose_config([f"experiment={EXP}", f"system={s}"]) for s in ("lobra", "task_fused")}


def test_every_point_types_and_changes_only_its_key(composed):
    for system, base in composed.items():
        h = typed(base.hinges)
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
            if system == "lobra" or inp.systems:
                assert typed_job(cfg).system_name == system
            if inp.systems and system not in inp.systems:
                assert overrides == [] and _changed(flat_zero, cfg) == set(), (k, inp.name)
                continue
            assert _changed(flat_zero, cfg) == {inp.key}, (k, inp.name)
            assert len(overrides) == 1 and overrides[0].startswith(f"{inp.key}=")
            j = flat[k - 1][1]
            got = OmegaConf.select(cfg, inp.key)
            got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
            if inp.values:
                assert got == inp.values[j]
            else:
                assert got == pytest.approx(OmegaConf.select(zero, inp.key) * inp.factors[j], rel=1e-9)


def test_settings_are_the_claims_presets():
    """Each swept setting wraps the README preset its claim matches, under an experiment of its own."""
    hinges = OmegaConf.to_container(OmegaConf.load(CONF / "hinges.yaml"))
    swept = str(hinges["hydra"]["sweeper"]["params"][SETTING_AXIS]).split(",")
    paper = load_paper(paper_dir() / "lobra.yaml")
    assert sorted(swept) == ["e2e_32b", "e2e_7b"]
    names = set()
    for name in swept:
        y = OmegaConf.to_container(OmegaConf.load(CONF / "hinge_settings" / f"{name}.yaml"))
        assert y["defaults"] == [{"/experiment/lobra@_global_": name}]
        names.add(y["experiment_name"])
        for claim in y["hinges"]["claims"]:
            assert [m.experiment for m in paper.entry(claim).match] == [f"lobra/{name}"]
    assert names == {f"lobra/hinges/{s}" for s in swept}
    n = len(points(typed({**hinges["hinges"], "paper": "lobra", "claims": ["x"]})))
    assert hinges["hydra"]["sweeper"]["params"]["hinges.point"] == f"range(0,{n + 1})"


def test_the_32b_setting_is_the_readme_preset():
    cfg = compose_config([f"experiment={EXP}", f"{SETTING_AXIS}=e2e_32b", "system=task_fused", "hinges.point=0"])
    preset = compose_config(["experiment=lobra/e2e_32b", "system=task_fused"])
    assert cfg.experiment_name == "lobra/hinges/e2e_32b"
    assert list(cfg.hinges.claims) == ["e2e_32b_vs_task_fused"]
    # The same job as the README preset's but for its name, its figure hook and the declaration.
    assert {k for k in _changed(_flat(preset), cfg) if not k.startswith("hinges.")} == {"experiment_name", "figure"}
    assert typed_job(cfg).hardware.name == "a800-80g-megatron"
