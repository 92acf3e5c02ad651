"""Simulator speed: one 1F1B iteration at S=128 stages, N=1024 micro-batches (goal < 0.2 s).

Three cases side by side in one run: the compiled engine fed a ScheduleTable (the simulator
alone), the compiled engine fed Action lists (the table conversion included), and the Python
loop. Each asserts the closed form, so a fast wrong answer fails."""
import pytest

from impl.common.cost import LinkCosts, StageCosts
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import generate
from impl.common.schedule.table import ScheduleTable
from impl.common.sim import CommModel, simulate_iteration

S, N = 128, 1024


@pytest.fixture(scope="module")
def big_1f1b():
    return insert_comm(generate("1f1b", S, N))


@pytest.fixture(scope="module")
def big_1f1b_table(big_1f1b):
    return ScheduleTable.from_schedule(big_1f1b)


def _timed(benchmark, schedule, engine):
    costs = StageCosts.uniform(S, 0.25, 0.5, 0.25)
    link = LinkCosts.uniform(S)
    simulate_iteration(schedule, costs, link, CommModel("in_stream"), engine=engine)  # numba JIT / cache load
    return benchmark.pedantic(simulate_iteration, args=(schedule, costs, link, CommModel("in_stream")),
                              kwargs={"engine": engine}, rounds=3, iterations=1)


# Dyadic op times keep the closed form exact: (N + S - 1)(tF + tB + tW) = N + S - 1 seconds.
def test_sim_speed_1f1b_s128_n1024(benchmark, big_1f1b_table):
    result = _timed(benchmark, big_1f1b_table, "auto")
    assert result.iteration_time_s == (N + S - 1) * 1.0
    assert result.bubble_fraction(0) == (S - 1) / (N + S - 1)


def test_sim_speed_1f1b_s128_n1024_from_action_lists(benchmark, big_1f1b):
    result = _timed(benchmark, big_1f1b, "auto")
    assert result.iteration_time_s == (N + S - 1) * 1.0
    assert result.bubble_fraction(0) == (S - 1) / (N + S - 1)


def test_sim_speed_1f1b_s128_n1024_python_loop(benchmark, big_1f1b):
    result = _timed(benchmark, big_1f1b, "python")
    assert result.iteration_time_s == (N + S - 1) * 1.0
    assert result.bubble_fraction(0) == (S - 1) / (N + S - 1)
