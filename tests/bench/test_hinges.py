"""The hinge framework (bench/hinges.py): points, their application to a job's config, the reader."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from bench import hinges as hg
from bench.config import compose_config
from bench.paper import load_papers
from bench.system_choice import choice_of
from bench.validate import typed_job
from impl.common.api import ConfigError


def _decl(**kw):
    base = {"paper": "hotspa", "claims": ["matrix_max_band"],
            "inputs": [{"name": "bw", "key": "hardware.inter_node_bw_bytes_per_s", "values": [1.0, 2.0, 4.0],
                        "source": "test"},
                       {"name": "eff", "key": "hardware.megatron.knobs.inter_node_comm_efficiency",
                        "factors": [0.5], "source": "test"}]}
    base.update(kw)
    return base


def test_points_enumerate_inputs_then_values():
    h = hg.typed(_decl())
    assert hg.points(h) == [(0, 0), (0, 1), (0, 2), (1, 0)]


@pytest.mark.parametrize("bad, field", [
    ({"paper": "???"}, "hinges.paper"),
    ({"claims": []}, "hinges.claims"),
    ({"point": 9}, "hinges.point"),
    ({"inputs": [{"name": "x", "key": "a.b", "values": [1], "factors": [2], "source": "s"}]}, "hinges.inputs[0]"),
    ({"inputs": [{"name": "x", "key": "a.b", "values": [1], "source": "s", "kind": "guess"}]}, "hinges.inputs[0].kind"),
    ({"inputs": [{"name": "x", "key": "a.b", "values": [1]}]}, "hinges.inputs[0].source"),
])
def test_bad_declarations_fail_in_one_line_naming_the_field(bad, field):
    with pytest.raises(ConfigError) as exc:
        hg.typed(_decl(**bad))
    assert str(exc.value).startswith(field) and "\n" not in str(exc.value)


def _job(point: int, system: str = "megatron_static"):
    return compose_config(["experiment=hotspa/hinges", "workload=hotspa_32b_32gpu_cc", f"system={choice_of(system)}",
                           f"hinges.point={point}"])


def test_point_zero_is_the_composed_job_and_a_point_sets_exactly_its_key():
    base = _job(0)
    assert hg.apply_point(base, ["x=1"]) == ["x=1"]
    h = hg.typed(base.hinges)
    for k, (i, j) in enumerate(hg.points(h), start=1):
        cfg = _job(k)
        ov = hg.apply_point(cfg, [])
        inp = h.inputs[i]
        if inp.systems and "megatron_static" not in inp.systems:
            assert ov == []
            continue
        assert ov == [f"{inp.key}={inp.values[j]}"]
        assert OmegaConf.select(cfg, inp.key) == inp.values[j]
        after = OmegaConf.to_container(cfg, resolve=True)
        assert after.pop("hinges")["point"] == k
        want = OmegaConf.to_container(base, resolve=True)
        want.pop("hinges")
        _drop(after, inp.key)
        _drop(want, inp.key)
        assert after == want, f"point {k} moved more than {inp.key}"
        typed_job(cfg)  # the value types


def _drop(d: dict, dotted: str) -> None:
    """Remove the key; a parent the point created (null in the composed job) reads null again."""
    head, _, rest = dotted.partition(".")
    if not rest:
        d.pop(head, None)
        return
    if isinstance(d.get(head), dict):
        _drop(d[head], rest)
        if not d[head]:
            d[head] = None


def test_a_system_restricted_input_leaves_the_other_systems_alone():
    h = hg.typed(_job(0).hinges)
    k = next(k for k, (i, _) in enumerate(hg.points(h), start=1) if h.inputs[i].systems)
    assert hg.apply_point(_job(k, system="hotspa"), []) == []
    assert hg.apply_point(_job(k, system="megatron_static"), []) != []


def test_a_key_the_job_lacks_is_refused_naming_it():
    cfg = _job(0)
    cfg.hinges.inputs[0].key = "hardware.no_such_group.bw"
    cfg.hinges.point = 1
    with pytest.raises(ConfigError, match="hardware.no_such_group.bw"):
        hg.apply_point(cfg, [])


def test_preflight_refuses_a_point_past_the_declaration():
    from bench.app import preflight

    err = preflight(["experiment=hotspa/hinges", "hinges.point=99", "workload=hotspa_7b_8gpu_cc", "system=hotspa/hotspa"])
    assert err and err.startswith("hinges.point") and "99" in err


# ------------------------------------------------------------------ the reader on synthetic records

def _rec(system: str, point: int, t: float, workload: str = "w", decl=None, status: str = "ok") -> dict:
    h = dict(decl or _decl())
    h["point"] = point
    return {"run_id": f"{system}-{point}-{workload}", "created": f"2026-01-01T00:00:{point:02d}", "system": system,
            "status": status, "experiment": "hotspa/hinges", "mode": "sim", "workload": workload,
            "hardware": f"h[{point}]", "fault": "none", "config": {"hinges": h},
            "metrics": {"step_time_s": {"value": t, "unit": "s", "better": "lower"}}}


def _records(speedups: dict[int, float]) -> list[dict]:
    out = []
    for p, s in speedups.items():
        out += [_rec("hotspa", p, 1.0), _rec("megatron_static", p, s)]
    return out


def test_reader_gives_each_end_and_where_a_missed_claim_would_hold():
    # matrix_max_band: 2.5-3.2x; as composed 1.2x; the bw input reaches 3.0x at its high end.
    recs = _records({0: 1.2, 1: 1.2, 2: 2.0, 3: 3.0, 4: 1.1})
    (ch,) = hg.analyze(recs, load_papers())
    assert ch.claim == "matrix_max_band" and ch.state == "below" and ch.base == pytest.approx(1.2)
    bw = next(s for s in ch.swings if s.input.name == "bw")
    assert bw.ends == (pytest.approx(1.2), pytest.approx(3.0))
    # linear between 2.0x at 2.0 and 3.0x at 4.0: 2.5x at 3.0 (as composed: no value in the config)
    assert bw.holds_in_range and bw.holds_at == pytest.approx(3.0) and bw.holds_side == ">="
    eff = next(s for s in ch.swings if s.input.name == "eff")
    assert not eff.holds_in_range and eff.figures == [pytest.approx(1.1)]
    assert "holds at >= 3" in hg.swing_text(bw)
    assert ch.swings[0] is bw  # the largest swing first


def test_reader_ignores_failed_records_and_other_experiments():
    recs = _records({0: 1.2, 1: 1.2, 2: 2.0, 3: 3.0, 4: 1.1})
    recs.append(_rec("megatron_static", 3, 99.0, status="failed"))
    other = _rec("megatron_static", 3, 99.0)
    other["experiment"] = "hotspa/sim_matrix"
    other["config"] = {}
    (ch,) = hg.analyze(recs + [other], load_papers())
    bw = next(s for s in ch.swings if s.input.name == "bw")
    assert bw.figures[-1] == pytest.approx(3.0)


def test_an_unknown_claim_is_refused_naming_it():
    recs = [_rec("hotspa", 0, 1.0, decl=_decl(claims=["nope"]))]
    with pytest.raises(ConfigError, match="nope"):
        hg.analyze(recs, load_papers())


def test_cli_reads_a_results_folder(tmp_path, capsys):
    assert hg.main(["--results", str(tmp_path / "none")]) == 2
    assert hg.main(["--results", str(tmp_path)]) == 1
