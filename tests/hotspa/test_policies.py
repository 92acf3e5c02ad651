"""HotSPa's policies as registered components: modes and real-mode plans from the component,
one-line errors from a Config that validates itself (also through the harness's merge)."""
from __future__ import annotations

import pytest

from bench.validate import typed_system
from impl.common.api import ConfigError
from impl.hotspa.policies import POLICIES, in_mode
from impl.hotspa.real import policy_plan
from impl.hotspa.system import HotSPa


def _system(**kw) -> HotSPa:
    cfg = HotSPa.Config(**kw)
    return HotSPa(cfg, cfg.policy)


def test_modes_and_real_plans_come_from_the_component():
    assert POLICIES.names() == ("hotspa", "hotspa_static", "megatron_static", "deepspeed_static", "megatron_grid")
    assert in_mode("real") == ("hotspa", "hotspa_static", "megatron_static")
    assert _system(policy="megatron_grid").modes == ("sim",) and _system(policy="hotspa").modes == ("sim", "real")
    s = _system(grouping="explicit", boundaries=[2048, 1024, 0], strategies=[[1, 2, 1], [2, 1, 1]])
    assert len(policy_plan(s, "hotspa", 2).strategies) == 2
    for p in ("hotspa_static", "megatron_static"):  # the home strategy alone in real mode
        plan = policy_plan(s, p, 2)
        assert plan.boundaries == (2048, 0) and plan.strategies == (plan.home,)


@pytest.mark.parametrize("key, value, msg", [
    ("policy", "hotspa_fast", "system.policy: unknown value 'hotspa_fast' (one of: hotspa, hotspa_static, "
                              "megatron_static, deepspeed_static, megatron_grid)"),
    ("pad", "zero", "system.pad: unknown value 'zero' (one of: align, bound)"),
    ("align", 0, "system.align: must be >= 1, got 0"),
])
def test_bad_knob_is_one_line_directly_and_through_the_harness_merge(key, value, msg):
    with pytest.raises(ConfigError) as e:
        HotSPa.Config(**{key: value})
    assert str(e.value) == msg
    with pytest.raises(ConfigError) as e:
        typed_system({"_target_": "impl.hotspa.system.HotSPa", "name": "hotspa", key: value})
    assert str(e.value) == msg
