"""HotSPa switch planner speed: every hot switch of the 32B/32-GPU preset's c2 grouping (home ->
each group's strategy -> home), planned by the bandwidth-aware greedy (impl.common.parallel.
migration), timed by pytest-benchmark (``--benchmark-enable``); without it, one run checked:
every switch moves state, the greedy's switch time no longer than round robin's."""
from __future__ import annotations

from impl.common.parallel.migration import plan_migration
from impl.hotspa.presets import load_presets
from impl.hotspa.cost import GRAD_BYTES, PARAM_BYTES, PricingEnv
from impl.hotspa.sim_config import HotSPaSimKnobs
from tests.hotspa.test_sim import _hw, _wl


def test_hotspa_switch_plans_32b_32gpu_c2(benchmark):
    wl = _wl("hotspa_32b_32gpu_cc")
    env = PricingEnv(wl, _hw(), HotSPaSimKnobs())
    gp = load_presets().group_plan("c2", wl.model.name, wl.num_gpus, wl.context)
    layouts = [gp.home, *reversed(gp.strategies[1:]), gp.home]
    pairs = [(env.plan(x), env.plan(y)) for x, y in zip(layouts, layouts[1:]) if x != y]
    assert pairs

    def plan_all():
        return [plan_migration(a, b, env.unit_params) for a, b in pairs]

    out = benchmark.pedantic(plan_all, rounds=1, iterations=1)
    assert all(transfers for transfers, _ in out)  # a change of strategy moves state
    for x, y in zip(layouts, layouts[1:]):
        assert env.switch_s(x, y, PARAM_BYTES + GRAD_BYTES, "bandwidth_greedy", True) <= \
            env.switch_s(x, y, PARAM_BYTES + GRAD_BYTES, "round_robin", True) * (1 + 1e-12)
