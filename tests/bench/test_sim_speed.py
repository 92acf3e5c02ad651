"""Simulator speed: one 1F1B iteration at S=128 stages, N=1024 micro-batches (target < 1 s)."""
import pytest

from impl.common.cost import LinkCosts, StageCosts
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import generate
from impl.common.sim import CommModel, simulate_iteration

S, N = 128, 1024


@pytest.fixture(scope="module")
def big_1f1b():
    return insert_comm(generate("1f1b", S, N))


def test_sim_speed_1f1b_s128_n1024(benchmark, big_1f1b):
    # Dyadic op times keep the closed form exact: (N + S - 1)(tF + tB + tW).
    costs = StageCosts.uniform(S, 0.25, 0.5, 0.25)
    link = LinkCosts.uniform(S)
    result = benchmark.pedantic(simulate_iteration, args=(big_1f1b, costs, link, CommModel("in_stream")),
                                rounds=3, iterations=1)
    assert result.iteration_time_s == (N + S - 1) * 1.0
    assert result.bubble_fraction(0) == (S - 1) / (N + S - 1)
