"""The scripts' inputs on the calibrated model (README, same title): the scripts' candidate lists, the grid-rule Megatron baseline on the
calibrated step model, one-line errors for bad pools."""
from __future__ import annotations

import pytest

from impl.common.api import ConfigError
from impl.common.baselines.megatron_grid import padded_docs
from impl.hydraulis.sim import parse_pool, simulate

from impl.common.hardware import load_hardware as hardware
from .test_sim import _system, _wl


def test_pool_text_parses_and_bad_entries_are_one_line():
    assert parse_pool(["(16,1)x4", "(16,1) + 6x(8,1)"], 64) == [[(16, 1)] * 4, [(16, 1)] + [(8, 1)] * 6]
    with pytest.raises(ConfigError) as e:
        parse_pool(["(16,1)x3"], 64)
    assert str(e.value) == "system.pool[0]: '(16,1)x3' uses 48 GPUs, not workload.num_gpus 64"
    with pytest.raises(ConfigError) as e:
        parse_pool(["(16,1)x4", "16,1"], 64)
    assert str(e.value).startswith("system.pool[1]: '16,1' is not")


def test_s1_uses_the_scripts_six_lists_with_the_first_as_optimizer_layout():
    wl = _wl("hydraulis_32b_64gpu_cc", steps=1)
    m, info = simulate(_system(), wl, hardware("a800-80g-megatron"), 0)
    assert info["opt_layout"] == "(4,16,1)"
    assert [p.split("  ")[0] for p in info["pool"]] == [
        "0: 4x(16,1)", "1: (16,1) + 6x(8,1)", "2: (16,1) + 12x(4,1)", "3: (8,3) + 10x(4,1)",
        "4: (8,1) + 14x(4,1)", "5: 8x(4,2)"]


def test_grid_rule_megatron_on_the_calibrated_model_and_zero_padding():
    docs = padded_docs([5, 6, 7, 8, 9], 4)
    assert len(docs) == 8 and sorted(x for x in docs if x) == [5, 6, 7, 8, 9] and docs.count(0) == 3
    wl = _wl("hydraulis_7b_16gpu_cc", steps=1)
    m, info = simulate(_system(policy="megatron_grid_like"), wl, hardware("a800-80g-megatron"), 0)
    assert info["fits_every_step"] and info["megatron_grid_layout"]
    assert m["overhead_time_s"].value == pytest.approx(info["breakdown_step0"]["per_iteration_s"])
    # one pricing path (README "One pricing path"): the datasheet profile carries the same step model, so the
    # grid baseline runs there too and prices the step alike
    m2, info2 = simulate(_system(policy="megatron_grid_like"), wl, hardware("a800-80g"), 0)
    assert info2["megatron_grid_layout"] == info["megatron_grid_layout"]
    assert m2["step_time_s"].value == pytest.approx(m["step_time_s"].value, rel=1e-9)
