"""Hydraulis' policies as registered components: modes from the component, one-line errors from a
Config that validates itself (also through the harness's merge)."""
from __future__ import annotations

import pytest

from bench.validate import typed_system
from impl.common.api import ConfigError
from impl.hydraulis.policies import POLICIES, in_mode
from impl.hydraulis.system import SIM_POLICIES, Hydraulis


def test_modes_come_from_the_component():
    assert SIM_POLICIES == in_mode("sim") and len(SIM_POLICIES) == 12
    assert in_mode("real") == ("hydraulis_h", "hydraulis_b0", "hydraulis_b1")
    for name, p in POLICIES.items():
        assert Hydraulis(Hydraulis.Config(policy=name), name).modes == p.modes
    assert POLICIES.get("hydraulis_b0").batching == "greedy" and POLICIES.get("hydraulis_h").pool == (("A", "B"),)


def test_unknown_policy_is_one_line():
    with pytest.raises(ConfigError) as e:
        Hydraulis.Config(policy="hydraulis_fast")
    assert str(e.value).startswith("system.policy: unknown policy 'hydraulis_fast' (one of: hydraulis, ")


@pytest.mark.parametrize("key, value, msg", [
    ("shuffles", 0, "system.shuffles: must be >= 1, got 0"),
    ("mip_rel_gap", 1.0, "system.mip_rel_gap: must be in [0, 1), got 1.0"),
    ("opt_layout", [2, 2], "system.opt_layout: need [dp, tp, pp] >= 1 each, got [2, 2]"),
    ("policy", "nope", "system.policy: unknown policy 'nope'"),
])
def test_bad_knob_through_the_harness_merge_is_the_same_one_line(key, value, msg):
    node = {"_target_": "impl.hydraulis.system.Hydraulis", "name": "hydraulis", key: value}
    with pytest.raises(ConfigError) as e:
        typed_system(node)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)
