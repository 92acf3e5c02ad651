"""Cross-paper presets (conf/experiment/cross/): every job of a preset resolves each
system against the same workload, hardware and fault configs (from the shared groups), every
job passes preflight or is refused by its system in one line (not applicable), and the cross
table shows a refusal as 'not applicable' with its line."""
from __future__ import annotations

import itertools
import pathlib

import pytest
from omegaconf import OmegaConf

from bench.config import compose_config
from bench.cross import QUESTIONS, cross_table, format_cross
from bench.validate import typed_job
from impl.common.api import NotApplicable

CONF = pathlib.Path(__file__).resolve().parents[2] / "conf"
PRESETS = sorted(p.stem for p in (CONF / "experiment" / "cross").glob("*.yaml"))


def jobs(preset: str) -> list[tuple[dict, object]]:
    """(the swept choices, composed config) of every job of the preset's sweep."""
    head = compose_config([f"experiment=cross/{preset}"], return_hydra_config=True)
    params = OmegaConf.to_container(head.hydra.sweeper.params)
    keys = list(params)
    out = []
    for values in itertools.product(*(str(params[k]).split(",") for k in keys)):
        combo = dict(zip(keys, values))
        cfg = compose_config([f"experiment=cross/{preset}", *(f"{k}={v}" for k, v in combo.items())])
        out.append((combo, cfg))
    return out


def test_there_are_the_three_questions():
    assert {"stragglers", "gpu_loss", "varlen"} <= set(PRESETS)
    assert all(f"cross/{p}" in QUESTIONS for p in PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_system_resolves_against_the_same_workload_hardware_and_fault(preset):
    text = (CONF / "experiment" / "cross" / f"{preset}.yaml").read_text()
    body = OmegaConf.load(CONF / "experiment" / "cross" / f"{preset}.yaml")
    # The shared groups only: no workload / hardware / fault node of the preset's own.
    assert not {"workload", "hardware", "fault"} & set(body), preset
    assert "not_applicable_ok: true" in text
    situations: dict[tuple, dict[str, tuple]] = {}
    systems = set()
    for combo, cfg in jobs(preset):
        situation = tuple(sorted((k, v) for k, v in combo.items() if k != "system"))
        groups = tuple(OmegaConf.to_yaml(cfg[g], resolve=True) for g in ("workload", "hardware", "fault"))
        situations.setdefault(situation, {})[combo["system"]] = groups
        systems.add(combo["system"])
    assert len(systems) >= 3 and len(situations) >= 2
    for situation, by_system in situations.items():
        assert set(by_system) == systems, situation
        distinct = set(by_system.values())
        assert len(distinct) == 1, f"{preset} {situation}: systems resolve different groups"
    # Every situation is a different config (the sweep is not one situation repeated).
    assert len({next(iter(v.values())) for v in situations.values()}) == len(situations)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_job_passes_preflight_or_is_refused_in_one_line(preset):
    refused, all_jobs = 0, jobs(preset)
    for combo, cfg in all_jobs:
        try:
            typed_job(cfg)
        except NotApplicable as exc:
            refused += 1
            assert "\n" not in str(exc) and ": " in str(exc), (combo, str(exc))
    assert refused < len(all_jobs)


def _rec(system, fault, value=None, na=None, mode="sim"):
    rec = {"experiment": "cross/stragglers", "system": system, "fault": fault, "mode": mode,
           "created": "2026-12-02T00:00:00+00:00", "status": "ok" if na is None else "failed",
           "error": na, "metrics": {}}
    if na is not None:
        rec["not_applicable"] = True
    else:
        rec["metrics"]["iteration_time_s"] = {"value": value, "unit": "s"}
    return rec


def test_cross_table_names_the_winner_and_shows_refusals_as_not_applicable():
    records = [_rec("adaptra", "slow_link", 1.0), _rec("zb", "slow_link", 2.0),
               _rec("malleus", "slow_link", na="fault.kind: system 'malleus' does not support fault 'link_delay'"),
               _rec("adaptra", "slow_gpu", 3.0), _rec("zb", "slow_gpu", 3.3), _rec("malleus", "slow_gpu", 1.5)]
    t = cross_table(records, "cross/stragglers")
    assert t.winner("slow_link")[:2] == ("adaptra", 2.0)
    assert t.winner("slow_gpu") == ("malleus", 2.0, "adaptra")
    text = format_cross(t)
    assert "not applicable" in text and "does not support fault 'link_delay'" in text
    assert "(simulated)" in text and "2.00x over zb" in text


def _sim(overrides):
    from bench.runner import execute

    return execute(compose_config(overrides), overrides, choices={"experiment": "cross/stragglers"})


def test_pipeline_systems_price_a_static_slow_gpu_on_the_shared_hybrid_workload(tmp_path):
    base = ["experiment=cross/stragglers", "system=adaptra/zb", "workload.iterations=1", "workload.warmup_iterations=0",
            f"results_dir={tmp_path}", "progress=false"]
    free, slow = _sim(base + ["fault=none"]), _sim(base + ["fault=slowdown_s1"])
    assert free["status"] == slow["status"] == "ok", (free["error"], slow["error"])
    t0, t1 = (r["metrics"]["iteration_time_s"]["value"] for r in (free, slow))
    assert t0 < t1 < 2.0 * t0  # stage 0 at 2x: slower, but not every stage
    # A slowdown trace is refused in one line (not applicable): ADAPTRA prices a static slow GPU only.
    cfg = compose_config(["experiment=cross/stragglers", "system=adaptra/adaptra", "fault=slowdown_b"])
    with pytest.raises(NotApplicable, match="static slow GPU only"):
        typed_job(cfg)
