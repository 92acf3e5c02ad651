"""LobRA deployment planner speed: the plan() call of experiment=lobra/e2e_7b (system=lobra/lobra,
recorded in data/), timed by pytest-benchmark (``--benchmark-enable``); without it, one run
checked for a deployment that fits the GPUs and holds the longest sequence."""
from __future__ import annotations

import json
import pathlib

from impl.lobra.cost.replica import Scheme, TpCost
from impl.lobra.plan import plan

DATA = pathlib.Path(__file__).parent / "data" / "lobra_e2e_7b_plan_calls.json"


def test_lobra_plan_e2e_7b(benchmark):
    (call,) = json.loads(DATA.read_text())["calls"]
    schemes = [Scheme(**{**s, "cost": TpCost(**{**s["cost"], "c": tuple(s["cost"]["c"])})}) for s in call["schemes"]]
    p = benchmark.pedantic(plan, args=(schemes, call["num_gpus"], call["buckets"], call["counts"], call["max_len"]),
                           kwargs=call["kwargs"], rounds=1, iterations=1)
    assert sum(g.dp * g.scheme.tp * g.scheme.pp for g in p.groups) <= call["num_gpus"]
    assert max(g.scheme.max_tokens for g in p.groups) >= call["max_len"]
    assert p.expected_step_s > 0
