"""Sim mode through the harness: scenario bands, determinism, bad input."""
from __future__ import annotations

import pytest

from impl.common.api import ConfigError
from tests.support.inprocess import run_job

BASE = ["mode=sim", "workload=hybrid_32b_dp4tp2pp4", "hardware=a800-80g"]


def _t(res):
    return res.metrics["iteration_time_s"].value


def test_s2_malleus_near_straggler_free_and_beats_uniform(tmp_path):
    m = run_job(BASE + ["system=malleus", "fault=slowdown_s2"], tmp_path / "m")
    u = run_job(BASE + ["system=uniform", "fault=slowdown_s2"], tmp_path / "u")
    assert m.metrics["slowdown_vs_straggler_free"].value <= 1.35
    assert 4.0 <= _t(u) / _t(m) <= 5.3
    assert u.metrics["slowdown_vs_straggler_free"].value == pytest.approx(5.0, rel=0.02)
    assert m.metrics["replans"].value == 1


def test_sim_is_deterministic(tmp_path):
    a = run_job(BASE + ["system=malleus", "fault=slowdown_s1"], tmp_path / "a")
    b = run_job(BASE + ["system=malleus", "fault=slowdown_s1"], tmp_path / "b")
    assert {k: v.to_dict() for k, v in a.metrics.items()} == {k: v.to_dict() for k, v in b.metrics.items()}


@pytest.mark.parametrize("overrides, match", [
    (["fault=slowdown_s1", "fault.gpus=[40]"], r"fault.gpus: GPU 40 does not exist"),
    (["fault=slowdown_s1", "fault.gpus=[8,9]"], r"node 1 has 2 straggling GPUs \[8, 9\], more than a node allows"),
    (["fault=slowdown_s1", "workload.memory.capacity_mb=60000"], r"workload.memory: the nominal layout does not fit"),
])
def test_bad_input_is_one_line(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        run_job(BASE + ["system=malleus"] + overrides, tmp_path)
    assert "\n" not in str(e.value)
