"""The pipeline simulator (flat-list compile and run loop, stack resumption) against the kept
reference implementation (``sim_reference.py``, the code before the speed-up): every op's
start/end, every message's send start and arrival, the breakdown and the iteration time are
compared with ==, on 1F1B / GPipe / ZB / ADAPTRA schedules, several S and N, every comm
model, with and without link delays (a table and a time-varying function), dp all-reduce,
and both batch_p2p settings, through both engines (the Python loop and the numba-compiled one, on
``Action`` lists and on a ``ScheduleTable``). Errors must carry the same message."""
import dataclasses
import random

import pytest

from impl.adaptra.builder import adaptra_schedule
from impl.common.api import ConfigError
from impl.common.cost import LinkCosts, StageCosts
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import generate
from impl.common.schedule.ir import parse_schedule
from impl.common.schedule.table import ScheduleTable
from impl.common.sim import CommModel, simulate_iteration, simulate_iterations

from . import sim_reference as ref

COMMS = [dict(kind="latency"), dict(kind="in_stream"), dict(kind="in_stream", queue_depth=None),
         dict(kind="in_stream", queue_depth=3), dict(kind="delegated", delegates=3),
         dict(kind="blocking", batch_p2p=False), dict(kind="in_stream", batch_p2p=False)]


def _costs(S, seed):
    rng = random.Random(seed)  # non-dyadic times, so any change in the order of additions shows
    return StageCosts.from_lists([rng.uniform(0.8, 1.3) * 0.011 for _ in range(S)],
                                 [rng.uniform(0.8, 1.3) * 0.023 for _ in range(S)],
                                 [rng.uniform(0.8, 1.3) * 0.013 for _ in range(S)])


def _schedules(S, N, costs):
    out = {name: insert_comm(generate(name, S, N)) for name in ("1f1b", "gpipe", "zb")}
    out["1f1b_rendezvous"] = insert_comm(generate("1f1b", S, N), blocking_sends=True)
    c = [0.0] * (S - 1)
    if S > 2:
        c[S // 2] = 0.03
    sched, _ = adaptra_schedule(list(costs.tf_s), list(costs.tb_s), list(costs.tw_s), c, N)
    out["adaptra"] = insert_comm(sched)
    return out


def assert_same(new, old):
    assert new.iteration_time_s == old.iteration_time_s
    assert new.start_s == old.start_s
    assert new.end_s == old.end_s
    assert new.tx_start_s == old.tx_start_s
    assert new.arrival_s == old.arrival_s
    assert new.busy_s == old.busy_s
    assert [dataclasses.astuple(b) for b in new.breakdown] == [dataclasses.astuple(b) for b in old.breakdown]
    assert new.n_links == old.n_links


def _both(schedule, costs, link, comm_kw, engine="auto", **kw):
    new = simulate_iteration(schedule, costs, link, CommModel(**comm_kw), engine=engine, **kw)
    old = ref.simulate_iteration(schedule, costs, link, ref.CommModel(**comm_kw), **kw)
    return new, old


def _delay_fn(i, t):
    return 0.004 * (1 + i % 3) if 0.05 < t < 0.3 else 0.0


ENGINES = ["python", "compiled", "table"]  # table: compiled, fed a ScheduleTable


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("S,N", [(1, 3), (2, 5), (4, 12), (5, 9), (8, 20)])
@pytest.mark.parametrize("comm_kw", COMMS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_fast_simulator_equals_reference(S, N, comm_kw, engine):
    costs = _costs(S, seed=S * 100 + N)
    link = LinkCosts((0.0017,) * (S - 1), msg_bytes=1e6, host_link_bw_bytes_per_s=2e10)
    straggler = {(S // 2 - 1, S // 2): 0.021} if S > 1 else {}
    for name, schedule in _schedules(S, N, costs).items():
        if comm_kw["kind"] == "blocking" and name != "1f1b_rendezvous":
            continue  # rendezvous sends need the rendezvous-safe placement
        for kw in ({}, {"delays": straggler}, {"delays": _delay_fn, "origin_s": 0.02},
                   {"dp_allreduce_s": 0.05, "delays": straggler}):
            if engine != "python" and callable(kw.get("delays")):
                continue  # a delay function runs in the Python loop only (tested below)
            if engine == "table":
                new = simulate_iteration(ScheduleTable.from_schedule(schedule), costs, link, CommModel(**comm_kw), **kw)
                old = ref.simulate_iteration(schedule, costs, link, ref.CommModel(**comm_kw), **kw)
                assert new.schedule == schedule  # the lazily rebuilt Action lists
            else:
                new, old = _both(schedule, costs, link, comm_kw, engine=engine, **kw)
            assert_same(new, old)


def test_fast_simulator_equals_reference_at_benchmark_scale():
    S, N = 32, 256  # 48k actions: engine="auto" picks the compiled engine
    costs = _costs(S, seed=7)
    link = LinkCosts.uniform(S, 0.0009)
    schedule = insert_comm(generate("1f1b", S, N))
    for kw in ({}, {"delays": {(3, 4): 0.013}}):
        assert_same(*_both(schedule, costs, link, dict(kind="in_stream"), **kw))
    assert_same(*_both(schedule, costs, link, dict(kind="in_stream"), engine="python"))


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_long_comm_runs_reorder_like_the_reference(engine):
    # more than one send and receive between two compute ops: batch_p2p posts all sends first
    text = ("0: F0 F1 SF0>1 RB0<1 SF1>1 RB1<1 BW0 BW1\n"
            "1: RF0<0 RF1<0 F0 F1 BW0 BW1 SB0>0 SB1>0")
    costs = _costs(2, seed=3)
    for comm_kw in COMMS[:5]:
        assert_same(*_both(parse_schedule(text), costs, LinkCosts.uniform(2, 0.002), comm_kw, engine=engine))


@pytest.mark.parametrize("text", [
    "0: F0 SF0>1 BW0\n1: F0 BW0",  # sent, never received
    "0: F0 BW0\n1: RF0<0 F0 BW0",  # received, never sent
    "0: F0 SF0>1 SF0>1 BW0\n1: RF0<0 F0 BW0",  # sent twice
    "0: F0 SF0>1 BW0\n1: RF0<0 RF0<0 F0 BW0",  # received twice
    "0: F0 SF0>0 BW0\n1: RF0<0 F0 BW0",  # wrong peer
    "0: RF0<1 F0 BW0\n1: F0 SB0>0 BW0",  # wrong direction
    "0: RB0<1 F0 SF0>1 BW0\n1: RF0<0 F0 BW0 SB0>0",  # deadlock
])
@pytest.mark.parametrize("engine", ENGINES)
def test_errors_match_reference(text, engine):
    schedule, costs, link = parse_schedule(text), _costs(2, seed=1), LinkCosts.uniform(2)
    with pytest.raises(ConfigError) as old:
        ref.simulate_iteration(schedule, costs, link, ref.CommModel("in_stream"))
    arg = ScheduleTable.from_schedule(schedule) if engine == "table" else schedule
    with pytest.raises(ConfigError) as new:
        simulate_iteration(arg, costs, link, CommModel("in_stream"), engine="auto" if engine == "table" else engine)
    assert str(new.value) == str(old.value)


def test_engine_choice_errors_are_one_line():
    schedule = insert_comm(generate("1f1b", 2, 3))
    costs, link = _costs(2, seed=1), LinkCosts.uniform(2)
    with pytest.raises(ConfigError, match="engine must be one of auto, python, compiled, got 'numba'"):
        simulate_iteration(schedule, costs, link, CommModel(), engine="numba")
    with pytest.raises(ConfigError, match="engine='compiled' takes a delay table, not a delay function"):
        simulate_iteration(schedule, costs, link, CommModel(), engine="compiled", delays=_delay_fn)
    with pytest.raises(ConfigError, match="do not match the 3 stages"):
        simulate_iteration(ScheduleTable.from_schedule(schedule), _costs(3, seed=1), LinkCosts.uniform(3),
                           CommModel())


def test_simulate_iterations_converts_a_large_schedule_once_and_matches_the_python_loop():
    S, N = 16, 256  # 24.5k actions: above COMPILED_MIN_ACTIONS
    costs, link = _costs(S, seed=11), LinkCosts.uniform(S, 0.0009)
    schedule = insert_comm(generate("1f1b", S, N))
    tables = [None, {(3, 4): 0.02}, None, {(3, 4): 0.02, (9, 10): 0.005}]
    fast = simulate_iterations([schedule] * 4, costs, link, CommModel("in_stream"), delays=tables)
    slow = simulate_iterations([schedule] * 4, costs, link, CommModel("in_stream"), delays=tables, engine="python")
    assert fast == slow
    assert fast[0] == fast[2] and fast[1] > fast[0]
