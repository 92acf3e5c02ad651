"""Malleus planner speed: a 1,024-GPU plan (128 nodes, DP16 TP8 PP8, 70B-like memory, three
straggling GPUs regrouped into shrunk TP groups), target < 2 s, and every plan the S1-S7
presets make (README table; ``pytest tests/speed/test_malleus_planner_speed.py
--benchmark-enable``). Both also check the plans equal the ones recorded before the speed-ups."""
import json
import pathlib

import pytest

from impl.common.parallel.cost import StageMemoryRows
from impl.common.parallel.ilp import clear_caches, ilp_a, ilp_a_value, ilp_b
from impl.common.parallel.plan import Plan, validate_plan
from impl.common.parallel.planner import PlannerConfig, plan

CFG = PlannerConfig(num_gpus=1024, gpus_per_node=8, dp=16, tp=8, pp=8, num_layers=80, num_microbatches=256,
                    alpha=(1.0, 1.9, 3.66, 7.22), memory=StageMemoryRows(1231, 416, 500, 4500, 81252, 8),
                    solver_a="highs", solver_b="search", max_stage_vectors=4, max_templates=500)


DATA = pathlib.Path(__file__).parent / "data"


def rates():
    x = [1.0] * 1024
    x[0], x[8], x[16] = 12.53, 12.53, 2.57
    return x


def test_planner_speed_1024_gpus(benchmark):
    clear_caches()  # solver answers a process keeps (impl.common.parallel.ilp): a cold plan
    res = benchmark.pedantic(plan, args=(CFG, rates()), rounds=1, iterations=1)
    golden = json.loads((DATA / "malleus_1024_plan.json").read_text())
    assert _outcome(res) == {k: v for k, v in golden.items() if k != "comment"}  # unchanged by the speed-ups
    validate_plan(res.plan, memory=CFG.memory)
    assert len(res.plan.suspended) == 3
    # within 5% of the balanced-work lower bound, far from the uniform plan's 12.53x
    assert res.z <= 1.05 * 80 * 256 / (125 + 3 / 1.9 + 3 / 3.66 + 3 / 7.22)


def test_search_solver_matches_highs():
    for zs, S, M in [([19.0, 23.0], [8, 6], 64), ([25.74, 19.0, 15.0, 15.0], [4] * 4, 64),
                     ([9.0, 9.5, 10.0, 12.3, 8.0], [9, 9, 8, 8, 8], 256)]:
        assert ilp_b(zs, S, M, "search")[0] == pytest.approx(ilp_b(zs, S, M, "highs")[0])


# ---------------------------------------------------------------------------------------
# the plans the presets make, unchanged by the speed-ups
# ---------------------------------------------------------------------------------------


def _outcome(res) -> dict:
    """What a caller sees of a plan: Z, the plan, and the top-k candidates a cost model re-scores."""
    return json.loads(json.dumps({"z": res.z, "plan": res.plan.to_dict(),
                                  "candidates": [[c.z, c.plan.to_dict()] for c in res.candidates]}))


def _config(c: dict) -> PlannerConfig:
    c = dict(c, alpha=tuple(c["alpha"]), shrink_penalty=tuple(c["shrink_penalty"]))
    c["memory"] = StageMemoryRows(**c["memory"]) if c["memory"] else None
    return PlannerConfig(**c)


def test_planner_s1_s7_plans_unchanged(benchmark):
    """Every plan() call of the Malleus S1-S7 presets (system=malleus/malleus, recorded), replayed from
    empty solver caches: the plans and candidates equal those of the planner before the ILP-A
    value search and the caches (data/malleus_s1_s7_calls.json)."""
    calls = json.loads((DATA / "malleus_s1_s7_calls.json").read_text())["calls"]
    assert sorted({c["setting"] for c in calls}) == [f"s{i}" for i in range(1, 8)]

    def replay():
        clear_caches()
        return [plan(_config(c["config"]), c["rates"], old_plan=Plan.from_dict(c["old_plan"]) if c["old_plan"] else None,
                     unavailable=c["unavailable"], label=c["label"]) for c in calls]

    results = benchmark.pedantic(replay, rounds=1, iterations=1)
    for c, res in zip(calls, results):
        assert _outcome(res) == c["expected"], c["setting"]


@pytest.mark.parametrize("seed", range(20))
def test_ilp_a_value_is_the_solvers_optimum(seed):
    import random

    rng = random.Random(seed)
    S = rng.randint(1, 6)
    y = [rng.choice([1.0, 1.5, 2.0, 2.5, 4.0, 7.25]) for _ in range(S)]  # exact products: no ulp ties
    L = rng.randint(S, 40)
    mem = StageMemoryRows(1231, 416, 500, 4500, rng.choice([20000, 40000, 81252]), 4)
    ratios = [rng.choice([1.0, 2.0]) for _ in range(S)]
    res = ilp_a(y, ratios, L, mem, "highs")
    assert ilp_a_value(y, ratios, L, mem) == (None if res is None else res[0])
