"""Paper scenarios S5 (DP-link straggler + Falcon), S6 (time-varying delays) and S7 (140B trace
with an RNIC failure) in sim mode, and their building blocks (BOCPD, ski-rental ladder)."""
from __future__ import annotations

import random

import pytest

from bench.system_choice import choice_of
from impl.common.fault_model.spec import VaryingLinkDelay
from faults.varying_delay import DelayTimeline
from impl.adaptra.detect import detect_changes
from impl.adaptra.falcon import SkiRentalLadder
from impl.common.api import ConfigError
from tests.support.inprocess import run_job

NO_PNG = "system.timeline=false"


# ---- S5: DP-link straggler ------------------------------------------------------------------
S5 = ["workload=gpt7b_dp2_pp4", "hardware=h800", "fault=dp_link_delay", "fault.stage=0", "fault.start_iter=5",
      "fault.detection=measured", "fault.delay_s=0.03", "workload.iterations=20", "workload.warmup_iterations=0",
      NO_PNG]


@pytest.fixture(scope="module")
def s5(tmp_path_factory):
    out = tmp_path_factory.mktemp("s5")
    return {s: run_job([f"system={choice_of(s)}", *S5], out) for s in ("zb", "falcon", "adaptra_cpu", "adaptra")}


def test_s5_ordering_at_30ms(s5):
    steady = {s: r.metrics["steady_iteration_time_s"].value for s, r in s5.items()}
    assert steady["adaptra"] <= steady["adaptra_cpu"] < steady["falcon"] < steady["zb"], steady
    mean = {s: r.metrics["mean_iteration_time_s"].value for s, r in s5.items()}
    assert mean["adaptra"] <= mean["adaptra_cpu"] < mean["falcon"] < mean["zb"], mean
    # Paper: a slow DP link costs ZB up to 8.04x. Ours 3.04x since every iteration pays the step
    # model's per-iteration terms (the no-delay time grows by them, the delay does not; 5x+ before):
    # the slow link still costs ZB a multiple of its no-delay time.
    assert s5["zb"].metrics["slowdown_vs_no_delay"].value > 2.5


def test_s5_remaps_after_detection_and_records_actions(s5):
    for system in ("adaptra", "adaptra_cpu"):
        (event,) = s5[system].info["events"]
        assert event["action"] == "remap" and 5 < event["iteration"] <= 9
    assert s5["zb"].info["events"] == []
    # At 30 ms the slowdown accumulated by detection already pays for "rebalance", so
    # "ignore" is never in force for a whole iteration; rebalance does not help, remap does.
    ladder = [a["action"] for a in s5["falcon"].info["action_in_force"]]
    assert ladder == ["none", "rebalance", "remap"]
    assert [e["action"] for e in s5["falcon"].info["events"]] == ["rebalance", "remap"]


def test_falcon_escalates_only_when_accumulated_cost_reaches_next_action(s5):
    info = s5["falcon"].info
    times = info["iteration_times_s"]
    (change,) = [c for c in info["mitigation"]["changes"] if c["after_mean"] > c["before_mean"]][:1]
    base, costs = change["before_mean"], info["mitigation"]["costs_s"]
    start = change["at"]  # accumulation starts at the change point
    for decision in info["mitigation"]["decisions"]:
        it, cost = decision["iteration"], costs[decision["action"]]
        acc = sum(t - base for t in times[start:it + 1])
        assert acc >= cost
        if it > change["detected_at"]:  # the iteration before, it had not yet paid for itself
            assert sum(t - base for t in times[start:it]) < cost
        start = it + 1


def test_ski_rental_ladder_steps():
    ladder = SkiRentalLadder({"rebalance": 1.0, "remap": 10.0, "restart": 300.0})
    assert ladder.charge(0.6) is None and ladder.action == "ignore"
    assert ladder.charge(0.6) == "rebalance"
    assert ladder.charge(-5.0) is None  # speed-ups do not pay back
    assert ladder.charge(9.9) is None
    assert ladder.charge(0.1) == "remap"
    assert ladder.charge(299.0) is None and ladder.charge(1.0) == "restart"
    assert ladder.charge(1e9) is None and ladder.action == "restart"


# ---- BOCPD ----------------------------------------------------------------------------------
def test_bocpd_detects_planted_step_within_a_few_iterations():
    rng = random.Random(1)
    series = [rng.gauss(1.0, 0.01) for _ in range(30)] + [rng.gauss(1.4, 0.01) for _ in range(20)]
    changes = detect_changes(series)
    assert len(changes) == 1
    assert changes[0].at == 30 and changes[0].detected_at <= 33
    assert changes[0].rel_change == pytest.approx(0.4, abs=0.02)


def test_bocpd_quiet_on_flat_series_and_small_steps():
    rng = random.Random(2)
    assert detect_changes([rng.gauss(1.0, 0.02) for _ in range(200)]) == []
    assert detect_changes([1.0] * 100) == []
    # A 5% step is a change, but below Falcon's 10% rule.
    assert detect_changes([1.0] * 30 + [1.05] * 30) == []


# ---- S6: time-varying delays ---------------------------------------------------------------
S6 = ["workload=gpt7b_pp4", "hardware=h800", "fault=varying_link_delay", "fault.interval_s=[0.05,0.1]",
      "workload.iterations=8", "workload.warmup_iterations=0", NO_PNG]


def test_delay_timeline_is_deterministic_per_seed():
    f = VaryingLinkDelay(interval_s=[0.05, 0.1], delay_s=[0.01, 0.06], seed=3)
    a, b = DelayTimeline(f, 4), DelayTimeline(f, 4)
    b.table_at(5.0)  # query order does not matter
    assert [a.table_at(t / 10) for t in range(50)] == [b.table_at(t / 10) for t in range(50)]
    segs = a.segments_until(5.0)
    assert all(0.05 <= t1 - t0 <= 0.1 for (t0, _), (t1, _) in zip(segs, segs[1:]))
    assert all(set(tab) == {(0, 1), (1, 2), (2, 3)} and all(0.01 <= d <= 0.06 for d in tab.values())
               for _, tab in segs)
    other = DelayTimeline(VaryingLinkDelay(interval_s=[0.05, 0.1], delay_s=[0.01, 0.06], seed=4), 4)
    assert [other.table_at(t / 10) for t in range(50)] != [a.table_at(t / 10) for t in range(50)]
    one = DelayTimeline(VaryingLinkDelay(links=[[2, 3]], links_per_change=1, seed=3), 4)
    assert all(set(tab) == {(2, 3)} for _, tab in one.segments_until(2.0))


def test_s6_reproducible_and_ordered(tmp_path):
    a = run_job(["system=adaptra/adaptra", *S6], tmp_path)
    b = run_job(["system=adaptra/adaptra", *S6], tmp_path)
    assert a.info["iteration_times_s"] == b.info["iteration_times_s"]
    c = run_job(["system=adaptra/adaptra", *S6, "fault.seed=7"], tmp_path)
    assert c.info["iteration_times_s"] != a.info["iteration_times_s"]
    assert a.info["distinct_plans"] > 1  # re-planned at iteration boundaries as delays changed
    t = {s: run_job([f"system={choice_of(s)}", *S6], tmp_path).metrics["mean_iteration_time_s"].value
         for s in ("zb", "adaptra_cpu")}
    assert a.metrics["mean_iteration_time_s"].value < t["adaptra_cpu"] < t["zb"], t


# ---- S7: 140B trace + RNIC failure -----------------------------------------------------------
S7 = ["workload=gpt140b_pp8", "hardware=h800", "fault=trace_140b", "workload.iterations=1200",
      "workload.warmup_iterations=0", NO_PNG]


def test_s7_total_time_ratio_and_restart_cost(tmp_path):
    r = {s: run_job([f"system={choice_of(s)}", *S7], tmp_path) for s in ("1f1b", "zb", "adaptra")}
    total = {s: x.metrics["total_time_min"].value for s, x in r.items()}
    # Paper: 1.41x over ZB and 1.37x over 1F1B. Ours (measured): 1.18x and 1.41x since every
    # iteration pays the step model's per-iteration terms (1.36x / 1.72x before; README "One pricing
    # path"); our 1F1B pays its full (S-1)/(N+S-1) = 23% warm-up bubble, the paper's much less.
    vs_zb, vs_1f1b = total["zb"] / total["adaptra"], total["1f1b"] / total["adaptra"]
    assert vs_zb >= 1.12 and vs_zb <= 1.55, total
    assert vs_1f1b >= 1.25 and vs_1f1b <= 1.80, total
    for baseline in ("1f1b", "zb"):
        (event,) = r[baseline].info["events"]
        assert event["action"] == "restart" and event["iteration"] == 1030
        assert r[baseline].metrics["one_time_costs_s"].value == 300.0
    (event,) = r["adaptra"].info["events"]
    assert event["action"] == "rnic_failover" and event["cost_s"] == 0.0
    assert r["adaptra"].metrics["one_time_costs_s"].value == 0.0


def test_rnic_restart_cost_is_a_parameter_charged_once(tmp_path):
    base = ["workload=pipeline_s4", "fault=link_delay", "fault.delay_s=0.0", "+fault.rnic_failure_iters=[3]", NO_PNG,
            "workload.iterations=6", "workload.warmup_iterations=0"]
    zb = run_job(["system=adaptra/zb", *base, "system.restart_cost_s=42"], tmp_path)
    assert zb.metrics["one_time_costs_s"].value == 42.0
    assert zb.metrics["total_time_s"].value == pytest.approx(sum(zb.info["iteration_times_s"]) + 42.0)
    ad = run_job(["system=adaptra/adaptra", *base], tmp_path)
    assert ad.metrics["one_time_costs_s"].value == 0.0
    # After the failover the delegates carry the traffic for the rest of the run.
    assert [p["comm"] for p in ad.info["plans"]] == ["in_stream"] * 3 + ["delegated"] * 3


# ---- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["workload=gpt7b_dp2_pp4", "fault=dp_link_delay", "fault.stage=4"],
     "fault.stage: stage 4 does not exist in a 4-stage pipeline"),
    (["workload=gpt7b_pp4", "fault=dp_link_delay"], "has no data-parallel link (workload.dp = 1"),
    (["workload=gpt7b_pp4", "fault=varying_link_delay", "fault.interval_s=[-0.1,0.1]"],
     "fault.interval_s must be > 0 seconds"),
    (["workload=gpt7b_pp4", "fault=varying_link_delay", "fault.delay_s=[]"],
     "fault.delay_s must be a range [low, high]"),
    (["workload=gpt7b_pp4", "fault=varying_link_delay", "fault.delay_s=[0.06,0.01]"],
     "fault.delay_s must be a range [low, high] with low <= high"),
    (["workload=gpt7b_pp4", "fault=varying_link_delay", "fault.links=[[3,4]]"],
     "fault.links: link (3, 4) does not exist in a 4-stage pipeline"),
    (["workload=pipeline_s4", "fault=link_delay", "+fault.rnic_failure_iters=[-1]"],
     "fault.rnic_failure_iters[0] must be >= 0"),
    (["workload=pipeline_s4", "mode=real", "fault=varying_link_delay"], "exists only in sim mode"),
])
def test_bad_scenario_input_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        run_job(["system=adaptra/adaptra", *overrides, NO_PNG], tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_falcon_rejects_pipeline_link_faults(tmp_path):
    with pytest.raises(ConfigError, match="does not support fault 'link_delay'"):
        run_job(["system=adaptra/falcon", "workload=pipeline_s4", "fault=link_delay", NO_PNG], tmp_path)
