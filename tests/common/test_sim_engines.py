"""The pipeline simulator's engines against each other and against what can be known without it.

The Python loop and the numba-compiled engine (fed ``Action`` lists or a ``ScheduleTable``)
are two implementations of one algorithm: every op's start/end, every message's send start
and arrival, the breakdown and the iteration time must agree with == (1F1B / GPipe / ZB /
ADAPTRA schedules, several S and N, every comm model, link delay tables, dp all-reduce, both
batch_p2p settings), and errors must carry the same message. What no engine decides alone:
tiny cases worked out by hand (dyadic times, so == holds), ADAPTRA's exact-replay oracle
(``impl.adaptra.milp.replay_order``) for the latency model, and invariants every result
obeys, a time-varying delay function (Python loop only) included."""
import dataclasses
import random

import pytest

from impl.adaptra.builder import adaptra_schedule
from impl.adaptra.milp import replay_order
from impl.common.api import ConfigError
from impl.common.cost import LinkCosts, StageCosts
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import generate
from impl.common.schedule.ir import Op, parse_schedule
from impl.common.schedule.table import ScheduleTable
from impl.common.sim import CommModel, simulate_iteration, simulate_iterations

COMMS = [dict(kind="latency"), dict(kind="in_stream"), dict(kind="in_stream", queue_depth=None),
         dict(kind="in_stream", queue_depth=3), dict(kind="delegated", delegates=3),
         dict(kind="blocking", batch_p2p=False), dict(kind="in_stream", batch_p2p=False)]
SIZES = [(1, 3), (2, 5), (4, 12), (5, 9), (8, 20)]


def _costs(S, seed):
    rng = random.Random(seed)  # non-dyadic times, so any change in the order of additions shows
    return StageCosts.from_lists([rng.uniform(0.8, 1.3) * 0.011 for _ in range(S)],
                                 [rng.uniform(0.8, 1.3) * 0.023 for _ in range(S)],
                                 [rng.uniform(0.8, 1.3) * 0.013 for _ in range(S)])


def _compute_only(S, N, costs):
    out = {name: generate(name, S, N) for name in ("1f1b", "gpipe", "zb")}
    c = [0.0] * (S - 1)
    if S > 2:
        c[S // 2] = 0.03
    out["adaptra"], _ = adaptra_schedule(list(costs.tf_s), list(costs.tb_s), list(costs.tw_s), c, N)
    return out


def _schedules(S, N, costs, comm_kw):
    """The schedules a comm model runs: rendezvous sends need the rendezvous-safe placement."""
    if comm_kw["kind"] == "blocking":
        return {"1f1b_rendezvous": insert_comm(generate("1f1b", S, N), blocking_sends=True)}
    return {name: insert_comm(s) for name, s in _compute_only(S, N, costs).items()}


def _link(S):
    return LinkCosts((0.0017,) * (S - 1), msg_bytes=1e6, host_link_bw_bytes_per_s=2e10)


def _delay_kws(S):
    straggler = {(S // 2 - 1, S // 2): 0.021} if S > 1 else {}
    return [{}, {"delays": straggler}, {"dp_allreduce_s": 0.05, "delays": straggler}]


def _delay_fn(i, t):
    return 0.004 * (1 + i % 3) if 0.05 < t < 0.3 else 0.0


def assert_same(a, b):
    assert a.iteration_time_s == b.iteration_time_s
    assert a.start_s == b.start_s
    assert a.end_s == b.end_s
    assert a.tx_start_s == b.tx_start_s
    assert a.arrival_s == b.arrival_s
    assert a.busy_s == b.busy_s
    assert [dataclasses.astuple(x) for x in a.breakdown] == [dataclasses.astuple(x) for x in b.breakdown]
    assert a.n_links == b.n_links


def _by_engine(schedule, costs, link, comm_kw, **kw):
    out = {engine: simulate_iteration(schedule, costs, link, CommModel(**comm_kw), engine=engine, **kw)
           for engine in ("python", "compiled")}
    out["table"] = simulate_iteration(ScheduleTable.from_schedule(schedule), costs, link, CommModel(**comm_kw), **kw)
    assert out["table"].schedule == schedule  # the lazily rebuilt Action lists
    return out


def _assert_invariants(res, schedule, costs, link, comm_kw, dp_allreduce_s=0.0):
    """What holds for any correct run, whatever the engine: times a reader can check by eye."""
    T = res.iteration_time_s
    dur = {Op.F: costs.tf_s, Op.B: costs.tb_s, Op.W: costs.tw_s}
    for s, acts in schedule.items():
        b = res.breakdown[s]
        parts = b.compute_s + b.copy_s + b.startup_s + b.dependency_s + b.hol_s + b.dp_allreduce_s + b.tail_s
        assert parts == pytest.approx(T, rel=1e-12, abs=1e-15)
        assert min(dataclasses.astuple(b)) >= -1e-15
        assert b.compute_s == pytest.approx(res.busy_s[s], rel=1e-12)
        prev_end = 0.0
        for k, a in enumerate(acts):
            start, end = res.start_s[s][k], res.end_s[s][k]
            assert 0.0 <= start <= end <= T
            if a.op.is_compute:  # compute ops run in list order, each for exactly its cost
                want = costs.tb_s[s] + costs.tw_s[s] if a.op is Op.BW else dur[a.op][s]
                assert end - start == pytest.approx(want, rel=1e-9)
                assert start >= prev_end
                prev_end = end
        assert prev_end + dp_allreduce_s <= T * (1 + 1e-12)
    assert T >= max(res.busy_s)
    base = {"delegated": comm_kw.get("cpu_penalty", 1.15)}.get(comm_kw["kind"], 1.0)
    for m, msg in res.messages():
        i = min(msg.src, msg.dst)
        assert res.arrival_s[m] >= res.tx_start_s[m] + base * link.p2p_s[i] * (1 - 1e-12)
    # each RECV's data is usable no earlier than its message arrived
    arrival = {(msg.src, msg.dst, msg.forward, msg.mb): res.arrival_s[m] for m, msg in res.messages()}
    for s, acts in schedule.items():
        for k, a in enumerate(acts):
            if a.op.is_recv:
                assert res.end_s[s][k] >= arrival[(a.peer, s, a.op is Op.RECV_F, a.mb)]


@pytest.mark.parametrize("S,N", SIZES)
@pytest.mark.parametrize("comm_kw", COMMS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_engines_agree_bit_for_bit_and_obey_the_invariants(S, N, comm_kw):
    costs, link = _costs(S, seed=S * 100 + N), _link(S)
    for name, schedule in _schedules(S, N, costs, comm_kw).items():
        for kw in _delay_kws(S):
            runs = _by_engine(schedule, costs, link, comm_kw, **kw)
            assert_same(runs["compiled"], runs["python"])
            assert_same(runs["table"], runs["python"])
            _assert_invariants(runs["python"], schedule, costs, link, comm_kw, kw.get("dp_allreduce_s", 0.0))


@pytest.mark.parametrize("S,N", SIZES)
@pytest.mark.parametrize("comm_kw", COMMS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_a_delay_function_obeys_the_invariants_and_a_constant_one_equals_its_table(S, N, comm_kw):
    costs, link = _costs(S, seed=S * 100 + N), _link(S)
    table = {(i, i + 1): 0.004 * (1 + i % 3) for i in range(S - 1)}
    for schedule in _schedules(S, N, costs, comm_kw).values():
        res = simulate_iteration(schedule, costs, link, CommModel(**comm_kw), delays=_delay_fn, origin_s=0.02)
        _assert_invariants(res, schedule, costs, link, comm_kw)
        as_fn = simulate_iteration(schedule, costs, link, CommModel(**comm_kw),
                                   delays=lambda i, t: 0.004 * (1 + i % 3), origin_s=0.02)
        assert_same(as_fn, simulate_iteration(schedule, costs, link, CommModel(**comm_kw), delays=table,
                                              engine="compiled"))


def test_engines_agree_at_benchmark_scale():
    S, N = 32, 256  # 48k actions: engine="auto" picks the compiled engine
    costs = _costs(S, seed=7)
    link = LinkCosts.uniform(S, 0.0009)
    schedule = insert_comm(generate("1f1b", S, N))
    for kw in ({}, {"delays": {(3, 4): 0.013}}):
        auto = simulate_iteration(schedule, costs, link, CommModel("in_stream"), **kw)
        assert_same(auto, simulate_iteration(schedule, costs, link, CommModel("in_stream"), engine="python", **kw))


@pytest.mark.parametrize("S,N", [(2, 5), (4, 12), (5, 9), (8, 20)])
def test_latency_model_equals_adaptras_exact_replay(S, N):
    # replay_order runs a compute-only F/B/W order as early as possible with lag c_i per hop:
    # the latency model's semantics with c_i = base + delay, computed without the simulator.
    costs = _costs(S, seed=S * 100 + N)
    link = _link(S)
    delays = {(S // 2 - 1, S // 2): 0.021}
    c = [link.p2p_s[i] + delays.get((i, i + 1), 0.0) for i in range(S - 1)]
    for name in ("zb", "adaptra"):
        order = _compute_only(S, N, costs)[name]
        _, makespan = replay_order(order, list(costs.tf_s), list(costs.tb_s), list(costs.tw_s), c)
        for engine in ("python", "compiled"):
            got = simulate_iteration(insert_comm(order), costs, link, CommModel("latency"), delays=delays,
                                     engine=engine)
            assert got.iteration_time_s == pytest.approx(makespan, rel=1e-12), name


# ---- tiny cases worked out by hand -----------------------------------------------------------
# 1F1B, S=2, N=2: F 0.25 s, B+W 0.75 s, 0.125 s per message. The lists are
#   0: F0 SF0>1 F1 SF1>1 RB0<1 BW0 RB1<1 BW1
#   1: RF0<0 F0 BW0 RF1<0 SB0>0 F1 BW1 SB1>0
# and (start, end) of each compute op, per stage, in list order, follow.
TINY = StageCosts.uniform(2, tf_s=0.25, tb_s=0.5, tw_s=0.25)
# Undelayed: F0 reaches stage 1 at 0.375; its BW0 ends at 1.375 and sends B0 (back at 1.5)
# before taking F1; B1 leaves at 2.375, is back at 2.5, stage 0's BW1 ends at 3.25.
UNDELAYED = {0: [(0.0, 0.25), (0.25, 0.5), (1.5, 2.25), (2.5, 3.25)],
             1: [(0.375, 0.625), (0.625, 1.375), (1.375, 1.625), (1.625, 2.375)]}
# Link (0, 1) +0.5 s: a message takes 0.625 s. in_stream (queue 1): SF1 at 0.5 waits for F0
# to be delivered (0.875): 0.375 s of head-of-line blocking; F1 lands at 1.5, before stage 1
# needs it (1.875). latency: no queue, the same compute times.
DELAYED = {0: [(0.0, 0.25), (0.25, 0.5), (2.5, 3.25), (3.5, 4.25)],
           1: [(0.875, 1.125), (1.125, 1.875), (1.875, 2.125), (2.125, 2.875)]}
# delegated, K=2, CPU 2x slower (0.25 s per message), 0.125 s per D2H/H2D copy on the stream:
# stage 0: F0, copy, F1 at 0.375, copy to 0.75; F0 arrives 0.625 (delegate 0), H2D to 0.75.
# stage 1 after BW0 (1.75): copy for B0 to 1.875, then H2D of F1 (arrived 1.0) to 2.0, F1,
# BW1 to 3.0, copy to 3.125. B0 arrives 2.125 (+copy: BW0 at 2.25), B1 3.375 (BW1 at 3.5).
DELEGATED = {0: [(0.0, 0.25), (0.375, 0.625), (2.25, 3.0), (3.5, 4.25)],
             1: [(0.75, 1.0), (1.0, 1.75), (2.0, 2.25), (2.25, 3.0)]}


def _compute_spans(res):
    return {s: [(res.start_s[s][k], res.end_s[s][k]) for k, a in enumerate(acts) if a.op.is_compute]
            for s, acts in res.schedule.items()}


@pytest.mark.parametrize("engine", ["python", "compiled", "table"])
@pytest.mark.parametrize("comm,link,delays,spans,T,hol0", [
    (CommModel("latency"), LinkCosts.uniform(2, 0.125), None, UNDELAYED, 3.25, 0.0),
    (CommModel("in_stream"), LinkCosts.uniform(2, 0.125), None, UNDELAYED, 3.25, 0.0),
    (CommModel("latency"), LinkCosts.uniform(2, 0.125), {(0, 1): 0.5}, DELAYED, 4.25, 0.0),
    (CommModel("in_stream"), LinkCosts.uniform(2, 0.125), {(0, 1): 0.5}, DELAYED, 4.25, 0.375),
    (CommModel("delegated", delegates=2, cpu_penalty=2.0),
     LinkCosts.uniform(2, 0.125, msg_bytes=1.0, host_link_bw_bytes_per_s=8.0), None, DELEGATED, 4.25, 0.0),
], ids=["latency", "in_stream", "latency-delayed", "in_stream-delayed-hol", "delegated"])
def test_tiny_1f1b_times_worked_out_by_hand(engine, comm, link, delays, spans, T, hol0):
    schedule = insert_comm(generate("1f1b", 2, 2))
    arg = ScheduleTable.from_schedule(schedule) if engine == "table" else schedule
    res = simulate_iteration(arg, TINY, link, comm, delays=delays, engine="auto" if engine == "table" else engine)
    assert res.iteration_time_s == T
    assert _compute_spans(res) == spans
    assert res.breakdown[0].hol_s == hol0 and res.breakdown[1].hol_s == 0.0
    if comm.kind == "delegated":  # two copies per message it sends or receives: 4 per stage
        assert [b.copy_s for b in res.breakdown] == [0.5, 0.5]


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_long_comm_runs_post_all_sends_first(engine):
    # more than one send and receive between two compute ops: batch_p2p posts all sends first,
    # so stage 0 sends F0 and F1 at 0.5 (both arrive 0.625) and stage 1 sends B0 and B1 at
    # 2.625 (2.75). In list order, stage 0 would wait in RB0 before sending F1: a deadlock.
    text = ("0: F0 F1 SF0>1 RB0<1 SF1>1 RB1<1 BW0 BW1\n"
            "1: RF0<0 RF1<0 F0 F1 BW0 BW1 SB0>0 SB1>0")
    link = LinkCosts.uniform(2, 0.125)
    res = simulate_iteration(parse_schedule(text), TINY, link, CommModel("latency"), engine=engine)
    assert res.iteration_time_s == 4.25
    assert _compute_spans(res) == {0: [(0.0, 0.25), (0.25, 0.5), (2.75, 3.5), (3.5, 4.25)],
                                   1: [(0.625, 0.875), (0.875, 1.125), (1.125, 1.875), (1.875, 2.625)]}
    with pytest.raises(ConfigError, match="^schedule deadlocks: "):
        simulate_iteration(parse_schedule(text), TINY, link, CommModel("latency", batch_p2p=False), engine=engine)


@pytest.mark.parametrize("text,message", [
    ("0: F0 SF0>1 BW0\n1: F0 BW0", "message F0 0->1 is sent but never received"),
    ("0: F0 BW0\n1: RF0<0 F0 BW0", "message F0 0->1 is received but never sent"),
    ("0: F0 SF0>1 SF0>1 BW0\n1: RF0<0 F0 BW0", "stage 0 action 2 (SF0>1): message sent twice"),
    ("0: F0 SF0>1 BW0\n1: RF0<0 RF0<0 F0 BW0", "stage 1 action 1 (RF0<0): message received twice"),
    ("0: F0 SF0>0 BW0\n1: RF0<0 F0 BW0", "stage 0 action 1 (SF0>0): its peer must be the next stage 1, within 0..1"),
    ("0: RF0<1 F0 BW0\n1: F0 SB0>0 BW0",
     "stage 0 action 0 (RF0<1): its peer must be the previous stage -1, within 0..1"),
    ("0: RB0<1 F0 SF0>1 BW0\n1: RF0<0 F0 BW0 SB0>0",
     "schedule deadlocks: 2 stage(s) wait forever: stage 0 at action 0 (RB0<1), stage 1 at action 0 (RF0<0)"),
])
@pytest.mark.parametrize("engine", ["python", "compiled", "table"])
def test_bad_schedules_fail_with_the_same_line_on_every_engine(text, message, engine):
    schedule, costs, link = parse_schedule(text), _costs(2, seed=1), LinkCosts.uniform(2)
    arg = ScheduleTable.from_schedule(schedule) if engine == "table" else schedule
    with pytest.raises(ConfigError) as err:
        simulate_iteration(arg, costs, link, CommModel("in_stream"), engine="auto" if engine == "table" else engine)
    assert str(err.value) == message


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
