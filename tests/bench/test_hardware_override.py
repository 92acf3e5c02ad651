"""A Hydra override of one step-model knob on a datasheet profile (``megatron.knobs: null``) moves
that knob only: the others stay the knobs carried from ``megatron.carried_from``."""
from __future__ import annotations

import dataclasses

import pytest

from bench.config import compose_config
from bench.validate import typed_hardware
from impl.common.api import ConfigError
from impl.common.hardware import load_hardware
from impl.common.megatron.derive import step_knobs
from impl.common.megatron.step import price
from impl.common.megatron.model import MegatronLayout, MegatronModel


def _hardware(*overrides: str):
    cfg = compose_config(["experiment=hydraulis/s2", "system=hydraulis/hydraulis", "hardware=a800-80g", *overrides])
    return typed_hardware(cfg.hardware)


@pytest.mark.parametrize("form", ["+hardware.megatron.knobs.gemm_time_factor={}",
                                  "hardware.megatron.knobs={{gemm_time_factor: {}}}"])
def test_one_knob_moves_on_top_of_the_carried_knobs(form):
    carried = step_knobs(load_hardware("a800-80g"))
    doubled = 2.0 * carried.gemm_time_factor
    hw = _hardware(form.format(doubled))
    assert hw.megatron.knobs == dataclasses.replace(carried, gemm_time_factor=doubled)
    # the profile still prices with the carried kernel tables and the overridden knob
    assert step_knobs(hw).iteration_overhead_s == carried.iteration_overhead_s > 0
    m = MegatronModel(num_layers=4, hidden=1024, heads=8, ffn_hidden=4096, vocab=32000)
    lay = MegatronLayout(dp=1, tp=1, pp=1, mbs=1, gbs=2, context=1024)
    slow, base = price(m, lay, hw), price(m, lay, load_hardware("a800-80g"))
    assert slow.iteration_s > base.iteration_s
    assert slow.allocatable_bytes == base.allocatable_bytes


def test_no_override_keeps_null_knobs_and_a_full_node_is_taken_whole():
    assert _hardware().megatron.knobs is None
    fitted = load_hardware("h100-megatron").megatron.knobs
    cfg = compose_config(["experiment=hydraulis/s2", "system=hydraulis/hydraulis", "hardware=h100-megatron",
                          "hardware.megatron.knobs.gemm_time_factor=1.1"])
    assert typed_hardware(cfg.hardware).megatron.knobs == dataclasses.replace(fitted, gemm_time_factor=1.1)


def test_unknown_knob_is_one_line():
    with pytest.raises(ConfigError, match=r"^hardware\.megatron\.knobs\.gemm_factor: not a step-model knob"):
        _hardware("+hardware.megatron.knobs.gemm_factor=1.1")
