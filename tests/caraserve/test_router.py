"""Rank-aware router (paper; weights [R], impl/caraserve/README.md "Router"): the numpy fast path decides exactly as the plain
per-request loop, and the marginal cost does not pile requests onto busy servers."""
from __future__ import annotations

import pytest

import impl.caraserve.sim as sim_mod
from impl.caraserve.router import RankAwareRouter, make_router
from impl.caraserve.sim import build_cost, simulate_policy
from tests.caraserve.test_sim import job, system


def test_fast_path_decides_exactly_as_reference(tmp_path, monkeypatch):
    seen = {"n": 0, "servers": set()}

    def checked(*a, **kw):
        r = make_router(*a, **kw)
        assert isinstance(r, RankAwareRouter)

        def route(q, servers, now):
            i = r(q, servers, now)
            assert i == r.reference(q, servers, now)
            seen["n"] += 1
            seen["servers"].add(i)
            return i
        return route

    monkeypatch.setattr(sim_mod, "make_router", checked)
    j = job(tmp_path, servers=6, n=300, rate=7.0)
    s = system()
    simulate_policy(s, j, s.trace(j), build_cost(s, j), "caraserve", "rank_aware")
    assert seen["n"] == 300 and len(seen["servers"]) == 6


@pytest.mark.parametrize("busy", [1, 10, 40])
def test_idle_server_is_preferred_over_a_busy_one(tmp_path, busy):
    """T(empty) is the fitted form's intercept, so an idle server is not charged the fixed step
    cost that a busy server has already paid (the piling bug: S3 SLO 22%)."""
    from impl.caraserve.cost import fit, profile_grid
    from impl.common.llm.scheduler import SReq
    from impl.common.servesim.cluster import SimServer
    from impl.common.sim.events import EventLoop

    j = job(tmp_path, servers=2)
    s = system()
    cost = build_cost(s, j)
    dec, pre = profile_grid(0)
    model = fit(dec, pre, lambda c, r: cost.decode_s(c, r), lambda l, r: cost.prefill_s(l, r))
    slo = lambda r: 2 * cost.decode_s([r.prompt_len], [r.rank])  # noqa: E731
    route = make_router("rank_aware", model=model, slo_of=slo)
    eng = EventLoop()
    servers = [SimServer(i, s.sched_config("caraserve", sim=True), cost, eng, lambda *a: None, slo) for i in range(2)]
    for k in range(busy):
        servers[0].sched.running.append(SReq(k, 0.0, f"a{k}", 16, 60, 100, generated=5, data={}))
    servers[0].version += 1
    q = SReq(999, 0.0, "q", 16, 60, 100, data={})
    assert route(q, servers, 0.0) == route.reference(q, servers, 0.0) == 1
