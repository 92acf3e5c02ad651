"""dLoRA request-adapter co-migration in the serving simulator (README "dLoRA"): it moves work
off an overloaded server, charges running requests their KV transfer, conserves requests, keeps
every latency above the isolated service time, is deterministic, and does nothing on one
server or for other policies."""
from __future__ import annotations

import dataclasses

import pytest

from impl.caraserve.sim import _requests, build_cost, simulate_policy
from impl.common.servesim import simulate
from tests.caraserve.test_sim import job, system

def run(tmp_path, migrate=True, servers=2, n=240, rate=5.0, seed=0, cost_edit=None, **kw):
    """Every arrival goes to server 0 (a deliberately bad placement only migration can fix)."""
    s = system("dlora", "mostidle", dlora_migrate=migrate, **kw)
    j = job(tmp_path, seed=seed, servers=servers, n=n, rate=rate)
    cost, trace = build_cost(s, j), s.trace(j)
    if cost_edit:
        cost = dataclasses.replace(cost, **cost_edit)
    scfg = s.sched_config(sim=True)
    scfg.load_groups = min(scfg.load_groups, cost.num_layers)

    def slo_of(r):
        return j.workload.slo_scale * cost.decode_s([r.prompt_len], [r.rank])

    def isolated_of(r):
        return cost.prefill_s([r.prompt_len], [r.rank]) + (r.output_len - 1) * cost.decode_s([r.prompt_len], [r.rank])

    reqs = _requests(trace)
    prompts = {r.rid: r.prompt_len for r in reqs}
    res = simulate(reqs, servers, scfg, cost, lambda q, sv, now: 0, slo_of, isolated_of=isolated_of)
    return res, cost, prompts


def mean_latency(res):
    return sum(r.latency_s for r in res.records) / len(res.records)


def test_migration_relieves_an_overloaded_server(tmp_path):
    off, _, _ = run(tmp_path, migrate=False)
    on, _, _ = run(tmp_path, migrate=True)
    assert {r.server for r in off.records} == {0}
    assert off.migrations["requests"] == 0 and off.migration_log == []
    m = on.migrations
    assert m["requests"] == len(on.migration_log) > 0 and m["adapters"] > 0 and m["ticks"] > 0
    assert m["waiting"] > 0 and m["running"] > 0 and m["kv_bytes"] > 0
    assert sum(1 for r in on.records if r.server == 1) > len(on.records) // 4
    assert mean_latency(on) < 0.8 * mean_latency(off)


def test_adapters_move_with_their_requests(tmp_path):
    res, _, _ = run(tmp_path)
    by_group: dict = {}
    for e in res.migration_log:
        by_group.setdefault((e.depart_s, e.src, e.dst), set()).add(e.adapter)
    moves = sum(len(a) for a in by_group.values())
    assert res.migrations["adapters"] <= moves  # an adapter is counted once per move, not per request
    assert res.migrations["adapters"] < res.migrations["requests"]  # some adapters carried several requests


@pytest.mark.parametrize("seed", [0, 1])
def test_conservation_and_isolated_time_hold(tmp_path, seed):
    res, _, _ = run(tmp_path, seed=seed, servers=3, n=300, rate=4.0)
    assert res.migrations["requests"] > 0
    assert len(res.records) + res.dropped == res.arrived == 300 and res.dropped == 0
    assert len({r.rid for r in res.records}) == 300
    assert all(r.latency_s >= r.isolated_s * (1 - 1e-9) for r in res.records)
    assert all(r.first_token_s >= r.arrival_s and r.done_s >= r.first_token_s for r in res.records)


def test_two_runs_are_identical(tmp_path):
    a, _, _ = run(tmp_path, servers=3)
    b, _, _ = run(tmp_path, servers=3)
    key = lambda res: [(r.rid, r.server, r.first_token_s, r.done_s, r.interruptions) for r in res.records]
    assert key(a) == key(b)
    assert a.migration_log == b.migration_log and a.migrations == b.migrations


def test_running_requests_pay_their_kv_transfer(tmp_path):
    # a slow interconnect (20 MB/s) makes each transfer seconds long, more than any schedule slack
    bw = 2e7
    res, cost, prompts = run(tmp_path, cost_edit={"intra_bw_bytes_per_s": bw})
    moved = [e for e in res.migration_log if e.kind == "running"]
    assert moved, "the scenario must move running requests"
    recs = {r.rid: r for r in res.records}
    for e in moved:
        r = recs[e.rid]
        ctx = round(e.kv_bytes / cost.kv_bytes_per_token())
        assert ctx == prompts[e.rid] + e.generated and e.generated >= 1
        assert e.arrive_s - e.depart_s == pytest.approx(cost.intra_latency_s + e.kv_bytes / bw)
        assert r.server == e.dst or any(x.rid == e.rid and x.depart_s > e.depart_s for x in res.migration_log)
        # no decode step while in transit: the rest of the output starts after landing
        remaining = r.output_len - e.generated
        step = cost.decode_s([ctx], [r.rank])
        assert r.done_s >= e.arrive_s + remaining * step * (1 - 1e-9)
    fast, _, _ = run(tmp_path)
    assert res.migrations["kv_bytes"] == pytest.approx(sum(e.kv_bytes for e in moved))
    slow_time = sum(e.arrive_s - e.depart_s for e in moved) / len(moved)
    fast_moved = [e for e in fast.migration_log if e.kind == "running"]
    assert slow_time > 5 * sum(e.arrive_s - e.depart_s for e in fast_moved) / len(fast_moved)


def test_single_server_is_a_no_op(tmp_path):
    on, _, _ = run(tmp_path, servers=1, n=120, rate=6.0, migrate=True)
    off, _, _ = run(tmp_path, servers=1, n=120, rate=6.0, migrate=False)
    assert on.migrations == off.migrations and on.migrations["requests"] == 0 and on.migrations["ticks"] == 0
    assert [(r.rid, r.done_s) for r in on.records] == [(r.rid, r.done_s) for r in off.records]


@pytest.mark.parametrize("policy", ["caraserve", "ondmd"])
def test_other_policies_never_migrate(tmp_path, policy):
    s = system(policy, "mostidle")
    j = job(tmp_path, servers=3, n=150, rate=5.0)
    res, _ = simulate_policy(s, j, s.trace(j), build_cost(s, j), policy, "mostidle")
    assert res.migrations is None and res.migration_log == []


def test_run_records_migrations(tmp_path):
    r = system("dlora", "mostidle").run(job(tmp_path, servers=3, n=150, rate=6.0))
    assert r.status == "ok", r.invalid_reasons
    assert set(r.info["migrations"]) >= {"requests", "adapters", "kv_bytes"}
    assert r.metrics["migrations"].value == r.info["migrations"]["requests"]


def test_bad_knobs_are_refused(tmp_path):
    from impl.common.api import ConfigError

    with pytest.raises(ConfigError, match="dlora_migrate_interval_s"):
        run(tmp_path, dlora_migrate_interval_s=0.0)
