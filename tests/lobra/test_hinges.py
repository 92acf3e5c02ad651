"""experiment=lobra/hinges: every point types, changes exactly its declared key, and its settings
are the README presets of the two claims (lobra/e2e_7b, lobra/e2e_32b) themselves, each under its
own experiment name with its own claim."""
from __future__ import annotations

import pathlib

from omegaconf import OmegaConf

from bench.config import compose_config
from bench.hinges import points, typed
from bench.paper import load_paper
from impl.common.systems import paper_file
from bench.validate import typed_job
from tests.support.hinge_points import changed_keys, check_points, flat_config

EXP = "lobra/hinges"
CONF = pathlib.Path(__file__).resolve().parents[2] / "conf" / "experiment" / "lobra"
SETTING_AXIS = "experiment/lobra/hinge_settings@_global_"


def test_every_point_types_and_changes_only_its_key():
    # an input restricted to the baseline runs on it (tests/support/hinge_points.py)
    assert check_points(EXP, ["system=lobra/lobra"]) == len(points(typed(compose_config([f"experiment={EXP}"]).hinges)))


def test_settings_are_the_claims_presets():
    """Each swept setting wraps the README preset its claim matches, under an experiment of its own."""
    hinges = OmegaConf.to_container(OmegaConf.load(CONF / "hinges.yaml"))
    swept = str(hinges["hydra"]["sweeper"]["params"][SETTING_AXIS]).split(",")
    paper = load_paper(paper_file("lobra"))
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
    cfg = compose_config([f"experiment={EXP}", f"{SETTING_AXIS}=e2e_32b", "system=lobra/task_fused", "hinges.point=0"])
    preset = compose_config(["experiment=lobra/e2e_32b", "system=lobra/task_fused"])
    assert cfg.experiment_name == "lobra/hinges/e2e_32b"
    assert list(cfg.hinges.claims) == ["e2e_32b_vs_task_fused"]
    # The same job as the README preset's but for its name, its figure hook and the declaration.
    assert {k for k in changed_keys(flat_config(preset), cfg) if not k.startswith("hinges.")} == {"experiment_name", "figure"}
    assert typed_job(cfg).hardware.name == "a800-80g-megatron"
