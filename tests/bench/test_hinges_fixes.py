"""Two reader/applier details of bench.hinges: a factor on an integer key stays an integer (the typed
config refuses 100000.0 for an int field), and a one-value input swings from the as-composed figure."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from bench.hinges import HingeInput, Swing, apply_point


def _cfg(point: int):
    return OmegaConf.create({
        "workload": {"token_budget": 100000, "lengths": {"median": 700.0}},
        "hinges": {"paper": "hydraulis", "claims": ["headline_band"], "point": point, "inputs": [
            {"name": "G", "key": "workload.token_budget", "factors": [0.5, 2.0], "source": "s"},
            {"name": "median", "key": "workload.lengths.median", "factors": [2.0], "source": "s"}]}})


def test_a_factor_on_an_integer_key_stays_an_integer():
    cfg = _cfg(1)
    assert apply_point(cfg, []) == ["workload.token_budget=50000"]
    assert cfg.workload.token_budget == 50000 and isinstance(cfg.workload.token_budget, int)
    cfg = _cfg(3)
    apply_point(cfg, [])
    assert cfg.workload.lengths.median == 1400.0 and isinstance(cfg.workload.lengths.median, float)


def test_a_one_value_input_swings_from_the_as_composed_figure():
    inp = HingeInput(name="NIC", key="hardware.inter_node_bw_bytes_per_s", values=[12.5e9], source="s")
    assert Swing(inp, [12.5e9], [0.91], base=1.04).span == pytest.approx(0.13)
    assert Swing(inp, [12.5e9], [0.91]).span == 0.0  # no point 0: nothing to swing from
