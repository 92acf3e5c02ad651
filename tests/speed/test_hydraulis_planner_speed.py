"""Hydraulis per-step planner speed: one 60k-token step of the 7B preset's length distribution
over the four candidate strategy sets (per-iteration planning as in the authors' code, PKU-DAIR/Hetu
`examples/hydraulis`), timed by pytest-benchmark
(``--benchmark-enable``); without it, one run checked against the plan invariants."""
from __future__ import annotations

import pytest

from impl.hydraulis.step_plan import check_plan, plan_step
from tests.hydraulis.conftest import LLAMA_7B, hardware
from tests.hydraulis.test_step_plan import G, batch


@pytest.fixture(scope="module")
def setup():
    from impl.common.workloads.varlen import VarlenModelShape
    from impl.hydraulis.cost.strategy import CostSpec, StrategyMemory, strategy_costs

    model, hw = VarlenModelShape(**LLAMA_7B), hardware("a800-80g")
    mem = StrategyMemory.for_job(model, hw, 32)
    c = {(r.tp, r.pp): r for r in strategy_costs(model, hw, mem, CostSpec(), 32)}
    pool = [[c[(4, 1)]] * 8, [c[(4, 1)]] * 3 + [c[(1, 4)]] * 5, [c[(8, 1)]] * 4,
            [c[(16, 1)], c[(2, 2)], c[(1, 4)]] + [c[(1, 4)]] * 3]
    return pool, mem


def test_hydraulis_plan_step_60k_tokens(benchmark, setup):
    pool, mem = setup
    L = batch(0)
    p = benchmark.pedantic(plan_step, args=(L, pool), kwargs=dict(shuffles=20, seed=0, time_limit_s=5),
                           rounds=1, iterations=1)
    check_plan(L, p, num_gpus=32, mem=mem)
    assert sum(L) == G
