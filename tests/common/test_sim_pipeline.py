"""Pipeline simulator: closed forms, the ZB simulator reference and ADAPTRA's theorem, HOL, traces, determinism, errors."""
import json

import pytest

from impl.common.fault_model.spec import DelayEvent, LinkDelay
from impl.common.api import ConfigError
from impl.common.cost import LinkCosts, StageCosts
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import generate, zb_warmup
from impl.common.schedule.ir import Op, parse_schedule
from impl.common.sim import (
    CommModel,
    EventLoop,
    simulate_iteration,
    simulate_iterations,
)

LATENCY = CommModel("latency")
NO_HOL = CommModel("in_stream", queue_depth=None)
T_OP = 0.01  # the ZB simulator reference (impl/adaptra/README.md): 10 ms ops


def sched(name, S, N):
    return insert_comm(generate(name, S, N))


def sim(schedule, costs, comm=LATENCY, delays=None, link=None, **kw):
    link = link or LinkCosts.uniform(costs.num_stages)
    return simulate_iteration(schedule, costs, link, comm, delays=delays, **kw)


def sends_first(actions):
    """Each run of comm actions between compute ops, sends before receives (batch_p2p)."""
    out, run = [], []
    for a in actions + [None]:
        if a is not None and not a.op.is_compute:
            run.append(a)
            continue
        out += [x for x in run if x.op.is_send] + [x for x in run if x.op.is_recv]
        run = []
        if a is not None:
            out.append(a)
    return out


def reference_latency_makespan(schedule, costs, delays, batch_p2p=True):
    """Independent oracle for the latency model: fixed-point longest path over the actions."""
    S = costs.num_stages
    if batch_p2p:
        schedule = {s: sends_first(acts) for s, acts in schedule.items()}
    dur = {Op.F: costs.tf_s, Op.B: costs.tb_s, Op.W: costs.tw_s}
    arrival, ends = {}, [None] * S
    while None in ends:
        progressed = False
        for s in range(S):
            if ends[s] is not None:
                continue
            t = 0.0
            for a in schedule[s]:
                if a.op.is_compute:
                    t += costs.tb_s[s] + costs.tw_s[s] if a.op is Op.BW else dur[a.op][s]
                elif a.op.is_send:
                    key = (s, a.peer, a.op is Op.SEND_F, a.mb)
                    if key not in arrival:
                        arrival[key] = t + delays.get((min(s, a.peer), min(s, a.peer) + 1), 0.0)
                        progressed = True
                else:
                    key = (a.peer, s, a.op is Op.RECV_F, a.mb)
                    if key not in arrival:
                        break
                    t = max(t, arrival[key])
            else:
                ends[s] = t
                progressed = True
        assert progressed, "reference oracle: schedule deadlocks"
    return max(ends)


# ---- closed forms ------------------------------------------------------------------------

# Dyadic op times keep every sum exact, so the closed forms hold with ==.
DYADIC = dict(tf_s=0.25, tb_s=0.5, tw_s=0.25)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (3, 1), (4, 4), (4, 8), (5, 2), (8, 16), (8, 24)])
@pytest.mark.parametrize("comm", [LATENCY, CommModel("in_stream"), CommModel("delegated", delegates=3)],
                         ids=["latency", "in_stream_q1", "delegated"])
def test_1f1b_uniform_bubble_fraction_is_exact(p, m, comm):
    costs = StageCosts.uniform(p, **DYADIC)
    r = sim(sched("1f1b", p, m), costs, comm)
    assert r.iteration_time_s == (m + p - 1) * (0.25 + 0.5 + 0.25)
    for s in range(p):
        assert r.bubble_fraction(s) == (p - 1) / (m + p - 1)
    assert r.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1), rel=1e-15)


@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (4, 8), (6, 3)])
def test_gpipe_iteration_time_closed_form(p, m):
    r = sim(sched("gpipe", p, m), StageCosts.uniform(p, **DYADIC), CommModel("in_stream"))
    assert r.iteration_time_s == (m + p - 1) * (0.25 + 0.5 + 0.25)


@pytest.mark.parametrize("S,N", [(2, 4), (4, 12), (4, 24), (6, 18)])
def test_zb_without_delay_has_only_the_fill_bubble(S, N):
    # With N >= 2S-1 the delay-blind ZB fills every stage after the first S-1 steps: (3N+S-1)t.
    r = sim(sched("zb", S, N), StageCosts.uniform(S, 1.0))
    assert r.iteration_time_s == 3 * N + S - 1


# ---- ZB simulator reference and the paper's theorem ----------------------------------------

def zb_times_ms(S, N, link, cs_ms, comm=LATENCY):
    schedule = sched("zb", S, N)
    costs = StageCosts.uniform(S, T_OP)
    return [sim(schedule, costs, comm, delays={link: c / 1e3}).iteration_time_s * 1e3 for c in cs_ms]


@pytest.mark.parametrize("S,N,link,cs_ms,spec_ms", [
    (4, 12, (0, 1), [0, 10, 20], [390, 400, 440]),  # ADAPTRA paper: "Sim, S=4, N=12, 10 ms ops"
    (4, 24, (0, 1), [0, 10, 20, 30, 40, 60], [750, 760, 880, 1020, 1160, 1440]),  # impl/adaptra/README.md [R]
    (4, 24, (2, 3), [60], [1560]),  # same reference, link (2,3) at 60
])
def test_zb_matches_spec_simulator_reference(S, N, link, cs_ms, spec_ms):
    # The reference has no HOL: the latency model (messages independent), with each
    # comm batch posted sends-first (batch_p2p, the default).
    assert zb_times_ms(S, N, link, cs_ms) == pytest.approx(spec_ms, abs=1e-6)


@pytest.mark.parametrize("comm", [LATENCY, NO_HOL], ids=["latency", "in_stream_unbounded"])
@pytest.mark.parametrize("link", [(0, 1), (2, 3)])
def test_zb_delay_theorem(comm, link):
    S, N = 4, 24
    warmup = zb_warmup(S, N)
    slack = warmup[link[0]] - warmup[link[1]]
    threshold_ms = (slack - 1) * T_OP * 1e3
    cs = [0, 2.5, 5, 10, 20, 30, 40, 60]
    ts = zb_times_ms(S, N, link, cs, comm)
    assert all(b >= a - 1e-9 for a, b in zip(ts, ts[1:])), f"not monotone in c: {ts}"
    for c, t in zip(cs, ts):
        if c <= threshold_ms:  # Θ(c): at most c (+ δ, δ -> 0 in a continuous-time sim)
            assert t - ts[0] <= c + 1e-6
    # Past the threshold the delay cascades: each extra ms of c costs several ms.
    beyond = [(c, t) for c, t in zip(cs, ts) if c > threshold_ms]
    for (c1, t1), (c2, t2) in zip(beyond, beyond[1:]):
        assert (t2 - t1) / (c2 - c1) >= 2.0, f"growth {c1}->{c2} ms not superlinear: {ts}"


@pytest.mark.parametrize("name,S,N", [("zb", 4, 12), ("1f1b", 4, 8), ("zb", 3, 7), ("gpipe", 3, 4)])
def test_latency_model_equals_longest_path_oracle(name, S, N):
    schedule = sched(name, S, N)
    costs = StageCosts.from_lists([0.01 * (1 + s) for s in range(S)], [0.02] * S, [0.005] * S)
    for delays in [{}, {(0, 1): 0.03}, {(i, i + 1): 0.007 * (i + 1) for i in range(S - 1)}]:
        for batch in (True, False):
            got = sim(schedule, costs, CommModel("latency", batch_p2p=batch), delays=delays).iteration_time_s
            assert got == pytest.approx(reference_latency_makespan(schedule, costs, delays, batch), rel=1e-12)


def test_batched_p2p_does_not_hold_sends_behind_receives():
    # insert_comm puts RF(j+1) before SB(j) on odd stages (rank parity); posted as one batch
    # the send leaves at once, in strict order it waits for the receive.
    S, N = 2, 24
    schedule = sched("1f1b", S, N)
    costs = StageCosts.uniform(S, T_OP)
    t = {b: [sim(schedule, costs, CommModel("in_stream", batch_p2p=b), delays={(0, 1): c}).iteration_time_s
             for c in (0.0, 0.01)] for b in (True, False)}
    assert t[True][0] == t[False][0]
    assert t[True][1] < t[False][1]
    r = sim(schedule, costs, CommModel("in_stream", batch_p2p=True), delays={(0, 1): 0.01})
    # results stay in schedule order even though batching moved actions
    assert [e >= s for s, e in zip(r.start_s[1], r.end_s[1])] == [True] * len(schedule[1])
    k_sb0 = schedule[1].index(next(a for a in schedule[1] if a.op is Op.SEND_B and a.mb == 0))
    k_rf1 = schedule[1].index(next(a for a in schedule[1] if a.op is Op.RECV_F and a.mb == 1))
    assert k_rf1 < k_sb0 and r.start_s[1][k_sb0] <= r.start_s[1][k_rf1]


# ---- comm models ---------------------------------------------------------------------------

def test_in_stream_worker_serialises_delayed_messages():
    # GPipe, 2 stages, tiny F: stage 0 emits messages faster than a delayed link carries them.
    N, c = 6, 0.05
    schedule = sched("gpipe", 2, N)
    costs = StageCosts.uniform(2, 0.001)
    lat = sim(schedule, costs, LATENCY, delays={(0, 1): c})
    q = sim(schedule, costs, NO_HOL, delays={(0, 1): c})
    fwd_lat = sorted(lat.arrival_s[m] for m, msg in lat.messages() if msg.forward)
    fwd_q = sorted(q.arrival_s[m] for m, msg in q.messages() if msg.forward)
    assert [b - a for a, b in zip(fwd_lat, fwd_lat[1:])] == pytest.approx([0.001] * (N - 1))
    assert [b - a for a, b in zip(fwd_q, fwd_q[1:])] == pytest.approx([c] * (N - 1))  # throughput 1/c
    assert all(b.hol_s == 0 for b in q.breakdown)


def test_hol_blocking_in_stream_but_not_delegated():
    S, N = 4, 12
    schedule = sched("zb", S, N)
    costs = StageCosts.uniform(S, T_OP)
    delays = {(0, 1): 0.06}
    gpu = sim(schedule, costs, CommModel("in_stream", queue_depth=1), delays=delays)
    cpu = sim(schedule, costs, CommModel("delegated", delegates=6), delays=delays)
    assert gpu.breakdown[0].hol_s > 0
    assert all(b.hol_s == 0 for b in cpu.breakdown)
    assert cpu.iteration_time_s < gpu.iteration_time_s
    deeper = sim(schedule, costs, CommModel("in_stream", queue_depth=4), delays=delays)
    assert deeper.breakdown[0].hol_s < gpu.breakdown[0].hol_s


def test_delegated_costs_copies_and_cpu_penalty():
    S, N = 2, 4
    schedule = sched("1f1b", S, N)
    costs = StageCosts.uniform(S, 0.25)
    link = LinkCosts((0.5,), msg_bytes=1e6, host_link_bw_bytes_per_s=1e7)  # copies of 0.1 s
    r = sim(schedule, costs, CommModel("delegated", delegates=2, cpu_penalty=1.25), link=link,
            delays={(0, 1): 0.125})
    m0 = next(m for m, msg in r.messages() if msg.forward and msg.mb == 0)
    # F0 ends at 0.25, D2H 0.1, then base·penalty + delay on the wire.
    assert r.tx_start_s[m0] == pytest.approx(0.35)
    assert r.arrival_s[m0] == pytest.approx(0.35 + 0.5 * 1.25 + 0.125)
    # Each stage sends N and receives N messages, each costing one copy on its stream.
    assert [b.copy_s for b in r.breakdown] == pytest.approx([2 * N * 0.1] * S)
    k = schedule[1].index(next(a for a in schedule[1] if a.op is Op.RECV_F and a.mb == 0))
    assert r.end_s[1][k] == pytest.approx(r.arrival_s[m0] + 0.1)  # H2D before the consumer


def test_breakdown_sums_to_iteration_time():
    S, N = 4, 12
    costs = StageCosts.uniform(S, T_OP)
    link = LinkCosts.uniform(S, 0.001, msg_bytes=1e6, host_link_bw_bytes_per_s=1e9)
    for comm in [LATENCY, CommModel("in_stream"), CommModel("delegated", delegates=3)]:
        r = sim(sched("zb", S, N), costs, comm, delays={(1, 2): 0.04}, link=link, dp_allreduce_s=0.02)
        for b in r.breakdown:
            total = b.compute_s + b.bubble_s
            assert total == pytest.approx(r.iteration_time_s, rel=1e-12)
            assert min(b.startup_s, b.dependency_s, b.hol_s, b.tail_s) >= -1e-12


def test_dp_allreduce_tail():
    S, N = 4, 8
    costs = StageCosts.uniform(S, **DYADIC)
    schedule = sched("1f1b", S, N)
    base = sim(schedule, costs).iteration_time_s
    r = sim(schedule, costs, dp_allreduce_s=0.5)
    assert r.iteration_time_s == base + 0.5  # stage 0 ends last, so its all-reduce is exposed
    assert r.breakdown[0].dp_allreduce_s == 0.5
    with pytest.raises(ConfigError, match="dp_allreduce_s"):
        sim(schedule, costs, dp_allreduce_s=[0.1, 0.2])


# ---- determinism, trace, errors ------------------------------------------------------------

def test_determinism():
    S, N = 4, 12
    schedule = sched("zb", S, N)
    costs = StageCosts.uniform(S, T_OP)
    runs = [sim(schedule, costs, CommModel("in_stream"), delays={(0, 1): 0.03, (2, 3): 0.02}) for _ in range(2)]
    a, b = runs
    assert a.iteration_time_s == b.iteration_time_s
    assert (a.start_s, a.end_s, a.arrival_s, a.breakdown) == (b.start_s, b.end_s, b.arrival_s, b.breakdown)
    assert a.to_chrome_trace() == b.to_chrome_trace()


def test_chrome_trace_is_valid_json_with_one_event_per_op(tmp_path):
    S, N = 3, 6
    schedule = sched("zb", S, N)
    r = sim(schedule, StageCosts.uniform(S, T_OP), CommModel("delegated", delegates=3), delays={(0, 1): 0.02})
    path = tmp_path / "trace.json"
    r.write_chrome_trace(path)
    trace = json.loads(path.read_text())
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "op"]
    assert len(ops) == sum(len(v) for v in schedule.values())
    assert {e["pid"] for e in ops} == set(range(S))
    assert sorted(e["name"] for e in ops if e["pid"] == 1) == sorted(str(a) for a in schedule[1])
    comm = [e for e in trace["traceEvents"] if e.get("cat") == "comm"]
    assert len(comm) == 2 * N * (S - 1)
    assert all(e["dur"] >= 0 and e["tid"] != 0 for e in comm)
    span = next(e for e in ops if e["pid"] == 0 and e["name"] == "F0")
    assert span["ts"] == 0 and span["dur"] == pytest.approx(T_OP * 1e6)
    assert len(r.timeline()) == len(ops)


def test_deadlock_raises_one_line_naming_stuck_stages():
    schedule = parse_schedule("0: F0 RB0<1 BW0 SF0>1\n1: RF0<0 F0 BW0 SB0>0")
    with pytest.raises(ConfigError, match=r"deadlocks.*stage 0 at action 1 \(RB0<1\).*stage 1 at action 0 \(RF0<0\)") as e:
        sim(schedule, StageCosts.uniform(2, 1.0))
    assert "\n" not in str(e.value)


def test_bad_schedules_raise():
    costs = StageCosts.uniform(2, 1.0)
    with pytest.raises(ConfigError, match=r"F0 0->1 is sent but never received"):
        sim(parse_schedule("0: F0 SF0>1 BW0\n1: F0 BW0"), costs)
    with pytest.raises(ConfigError, match="sent twice"):
        sim(parse_schedule("0: F0 SF0>1 SF0>1\n1: RF0<0 F0"), costs)
    with pytest.raises(ConfigError, match="next stage"):
        sim(parse_schedule("0: F0\n1: F0 SF0>0"), costs)
    with pytest.raises(ConfigError, match="do not match the 2 stages"):
        sim(parse_schedule("0: F0"), costs)
    with pytest.raises(ConfigError, match=r"link \(0, 2\)"):
        sim(parse_schedule("0: F0\n1: F0"), costs, delays={(0, 2): 0.1})
    with pytest.raises(ConfigError, match="queue_depth"):
        CommModel("in_stream", queue_depth=0)
    with pytest.raises(ConfigError, match="kind"):
        CommModel("nccl")


# ---- many iterations, delay traces ---------------------------------------------------------

def test_simulate_iterations_with_changing_delays_and_schedules():
    S, N = 4, 12
    costs = StageCosts.uniform(S, T_OP)
    link = LinkCosts.uniform(S)
    zb, f1b = sched("zb", S, N), sched("1f1b", S, N)
    tables = [{}, {(0, 1): 0.02}, {(0, 1): 0.02}, {}]
    times = simulate_iterations([zb, zb, f1b, f1b], costs, link, NO_HOL, delays=tables)
    expect = [sim(s, costs, NO_HOL, delays=d).iteration_time_s for s, d in zip([zb, zb, f1b, f1b], tables)]
    assert times == expect
    # A delay function of absolute time: constant -> same as the table.
    fn_times = simulate_iterations([zb, zb], costs, link, NO_HOL, delays=lambda i, t: 0.02 if i == 0 else 0.0)
    assert fn_times == [expect[1]] * 2
    # A delay that starts mid-iteration 1 affects only messages sent after it.
    start = expect[0] + 0.1
    mid = simulate_iterations([zb, zb], costs, link, NO_HOL, delays=lambda i, t: 0.02 if (i == 0 and t >= start) else 0.0)
    assert mid[0] == expect[0] and expect[0] < mid[1] <= expect[1]
    with pytest.raises(ConfigError, match="2 per-iteration tables for 3 schedules"):
        simulate_iterations([zb] * 3, costs, link, NO_HOL, delays=[{}, {}])



def test_engine_orders_ties_by_insertion():
    eng, seen = EventLoop(), []
    for name, at in [("a", 1.0), ("b", 0.5), ("c", 1.0), ("d", 0.5)]:
        eng.schedule(at, seen.append, name)
    assert eng.run() == 4 and seen == ["b", "d", "a", "c"]
    with pytest.raises(ValueError, match="in the past"):
        eng.schedule(0.1, seen.append, "late")
