"""The paper's settings: measured load profile by bytes, S-LoRA's eviction and copy path, stall accounting
as the paper counts it, HF-PEFT and its SLO reference, per-request adapters, paper figures."""
from __future__ import annotations

import dataclasses
import pathlib

import pytest

from impl.caraserve.figures import paper_values, s1_table, s1_vs_paper, stall_share_vs_paper
from impl.caraserve.sim import build_cost, simulate_policy
from impl.caraserve.system import ServingSystem
from impl.common.api import ConfigError, JobContext
from impl.common.hardware import HardwareProfile
from impl.caraserve.policies import serving
from impl.common.llm.scheduler import BatchScheduler, SchedulerConfig, SReq
from impl.common.servesim.cost import ServingCost, ServingCostConfig
from impl.common.servesim.load_profile import A10_V1_FIG3
from impl.common.traces import TraceSpec, generate_trace
from impl.common.workloads.serving import PaperModel, ServingAdapters, ServingTrace, ServingWorkload

A10 = HardwareProfile(name="a10", peak_flops={"fp16": 125e12}, memory_bytes=24 * 2**30, memory_bw_bytes_per_s=600e9,
                      intra_node_bw_bytes_per_s=32e9, intra_node_latency_s=5e-6, host_link_bw_bytes_per_s=32e9)
H100 = dataclasses.replace(A10, name="h100-sxm")


def cost(hw=A10, **kw) -> ServingCost:
    return ServingCost.from_profile(PaperModel(), hw, ServingCostConfig(**kw))


def test_measured_table_is_reproduced_at_its_own_points_and_interpolated_by_bytes():
    c = cost(lora_sites=3)  # the paper's q,k,v adapter: bytes equal the table's
    for r, t in zip(A10_V1_FIG3.ranks, A10_V1_FIG3.times_s):
        assert c.load_s(r) == pytest.approx(t, rel=1e-12)
    assert c.load_s(48) == pytest.approx((11.8e-3 + 20.6e-3) / 2)  # halfway in bytes
    assert c.load_model_used == "measured:a10:caraserve-v1-fig3"
    # 4 sites at rank 48 move the bytes of 3 sites at rank 64
    assert cost(lora_sites=4).load_s(48) == pytest.approx(20.6e-3)
    times = [c.load_s(r) for r in (1, 4, 8, 16, 64, 128, 256)]
    assert all(a < b for a, b in zip(times, times[1:])) and times[0] > 0
    # ~2.4x the roofline price of the same adapter (paper v1 Fig. 3-right: ~4-5 GB/s effective, not 22 GB/s)
    roof = cost(lora_sites=3, load_model="roofline")
    assert roof.load_model_used == "roofline" and 2.0 < c.load_s(64) / roof.load_s(64) < 3.0


def test_load_model_auto_falls_back_to_roofline_and_measured_is_refused_without_a_table():
    assert cost(H100).load_model_used == "roofline"
    with pytest.raises(ConfigError, match=r"^system.cost.load_model=measured: hardware 'h100-sxm' has no measured"):
        cost(H100, load_model="measured")
    with pytest.raises(ConfigError, match=r"^system.cost.load_model: unknown 'fast'"):
        ServingCostConfig(load_model="fast")


def test_slora_copies_move_twice_the_bytes():
    c = cost(lora_sites=3)
    assert c.load_s(64, 2.0) == pytest.approx(c.load_s(128))


def sreq(i, adapter, out=3, t=0.0):
    return SReq(rid=i, arrival_s=t, adapter=adapter, rank=16, prompt_len=4, output_len=out, data={})


def test_evict_on_finish_drops_every_adapter_the_remaining_batch_does_not_use():
    for evict, kept in ((True, {"b"}), (False, {"a", "b"})):
        s = BatchScheduler(SchedulerConfig(policy=serving("slora"), max_batch=4, pool_slots=8, evict_on_finish=evict))
        s.arrive(sreq(0, "a", out=2))
        s.arrive(sreq(1, "b", out=5))
        p = s.plan(lambda r: True)
        s.prefilled(p)
        done = s.decoded(s.plan(lambda r: True))
        assert [r.rid for r in done] == [0]
        assert set(s.pool.entries) == kept


def job(tmp_path, wl):
    return JobContext(mode="sim", seed=0, experiment="t", workload=wl, workload_name="t", hardware=A10,
                      hardware_name="a10", fault=None, fault_name="none", out_dir=pathlib.Path(tmp_path),
                      show_progress=False)


def system(policy, **kw):
    return ServingSystem(ServingSystem.Config(policy=policy, router="mostidle", plots=False, **kw), policy)


def test_slora_misses_on_every_arrival_of_a_hot_adapter_once_it_idles(tmp_path):
    # one adapter, requests spaced so each finishes before the next arrives
    wl = ServingWorkload(trace=ServingTrace(num_requests=20, rate_rps=0.5, output_median=8, sigma=0.1),
                         adapters=ServingAdapters(num_adapters=1, ranks=[64], rank_weights=[1.0]))
    j = job(tmp_path, wl)
    loads = {}
    for ev in ("on_finish", "lru"):
        s = system("slora", adapter_eviction=ev)
        res, _ = simulate_policy(s, j, s.trace(j), build_cost(s, j), "slora", "mostidle")
        loads[ev] = res.loads
        recs = res.records
    # on_finish: a load for every arrival that finds no earlier request still in the server
    idle = sum(1 for k, r in enumerate(recs) if all(q.done_s <= r.arrival_s for q in recs[:k]))
    assert 10 <= idle < 20 and loads == {"on_finish": idle, "lru": 1}


def test_stall_is_counted_for_the_loading_request_and_every_decode_it_pauses(tmp_path):
    wl = ServingWorkload(trace=ServingTrace(num_requests=60, rate_rps=8.0, output_median=40),
                         adapters=ServingAdapters(num_adapters=60, per_request=True, ranks=[64], rank_weights=[1.0]))
    j = job(tmp_path, wl)
    s = system("ondmd")
    c = build_cost(s, j)
    res, _ = simulate_policy(s, j, s.trace(j), c, "ondmd", "mostidle")
    assert res.loads == 60
    # each load stalls its own request and every request decoding at that moment
    assert all(r.load_stalls >= 1 and r.stall_s >= c.load_s(64) * (1 - 1e-9) for r in res.records)
    assert sum(r.stall_s for r in res.records) > res.stall_s * 1.5  # others' loads count too
    assert max(r.load_stalls for r in res.records) > 1
    out = s.run(j)
    share = sum(r.stall_s for r in res.records) / sum(r.latency_s for r in res.records)
    assert out.metrics["stall_share"].value == pytest.approx(share)
    assert out.metrics["stall_share_server"].value == pytest.approx(res.stall_s / res.busy_s)
    cached = system("cached").run(j)
    assert cached.metrics["stall_share"].value == 0 and cached.metrics["load_stalls_p50"].value == 0


def test_per_request_trace_has_one_distinct_adapter_per_request():
    t = generate_trace(TraceSpec(num_requests=50, per_request=True, ranks=[32], rank_weights=[1.0]), 0)
    assert len({r.adapter for r in t.requests}) == 50 == len(t.adapters)
    assert set(t.adapters.values()) == {32}


def test_hf_peft_never_batches_across_adapters():
    s = BatchScheduler(SchedulerConfig(policy=serving("hf_peft"), max_batch=8, pool_slots=8))
    for i, a in enumerate("abab"):
        s.arrive(sreq(i, a, out=3))
    p = s.plan(lambda r: True)
    assert p.merged == "a" and [r.adapter for r in p.reqs] == ["a", "a"]
    s.prefilled(p)
    while s.busy():
        p = s.plan(lambda r: True)
        assert len({r.adapter for r in p.reqs}) == 1 and p.merged == p.reqs[0].adapter
        (s.prefilled if p.kind == "prefill" else s.decoded)(p)


def test_slo_from_an_hf_peft_run(tmp_path):
    wl = ServingWorkload(trace=ServingTrace(num_requests=120, rate_rps=20.0, output_median=20),
                         adapters=ServingAdapters(num_adapters=50), num_servers=2, slo_scale=1.5,
                         slo_reference="hf_peft", slo_reference_requests=40)
    r = ServingSystem(ServingSystem.Config(policy="caraserve", router="mostidle", plots=False), "c").run(job(tmp_path, wl))
    ref = r.info["slo_reference"]
    assert ref["system"] == "hf_peft" and ref["requests"] == 40
    merged_b1 = build_cost(system("hf_peft"), job(tmp_path, wl)).decode_s([60], [16], lora=False)
    assert merged_b1 * 0.9 < ref["tpot_mean_s"] < merged_b1 * 1.5
    assert ref["slo_tpot_s"] == pytest.approx(1.5 * ref["tpot_mean_s"])
    with pytest.raises(ConfigError, match=r"^workload.slo_reference: unknown 'nope'"):
        system("caraserve").check("sim", dataclasses.replace(wl, slo_reference="nope"), A10, None)
    with pytest.raises(ConfigError, match=r"^system.policy: hf_peft is sim only"):
        system("hf_peft").check("real", wl, A10, None)


def record(policy, rate, rank, lat, status="ok"):
    return {"status": status, "system": policy, "metrics": {"latency_mean_s": {"value": lat}, "stall_share": {"value": 0.1}},
            "config": {"system": {"policy": policy},
                       "workload": {"adapters": {"per_request": True, "ranks": [rank], "num_adapters": 1},
                                    "trace": {"rate_rps": rate}}}}


def test_s1_figure_puts_ours_beside_the_papers(tmp_path):
    recs = [record("cached", 9, 64, 2.0), record("ondmd", 9, 64, 3.0), record("slora", 9, 64, 3.2),
            record("caraserve", 9, 64, 2.0, "invalid")]
    t = s1_table(recs)["9rps_r64"]
    assert t["ratio"] == pytest.approx(1.6) and t["over_cached"]["ondmd"] == pytest.approx(0.5)
    assert t["flagged"] == ["caraserve"]
    paper = paper_values()
    assert paper["slora_over_caraserve_9rps_r64"] == 1.38 and paper["cold_start_share_9rps"] == 0.20
    assert s1_vs_paper(recs, tmp_path)[0].name == "s1_synthetic_vs_paper.png"
    assert stall_share_vs_paper(recs, tmp_path)[0].exists()
    assert s1_vs_paper([], tmp_path) == []
