import json

import pytest

from impl.common.api import ConfigError
from impl.common.traces.addons import generate_addon_trace, load_addon_trace, save_addon_trace
from impl.common.workloads.diffusion_serving import AddonTraceSpec
from impl.swiftdiffusion.cache import LRUCache
from impl.swiftdiffusion.profile import SimProfile
from impl.swiftdiffusion.sim.serving import scale_arrivals, simulate_diffusers, simulate_katz
from impl.swiftdiffusion.sim.run import ARTIFACT, _sequential


@pytest.fixture(scope="module")
def reqs():
    return generate_addon_trace(AddonTraceSpec(num_requests=600), 1)


def test_trace_mix_follows_spec(reqs):
    a = [r for r in reqs if r.service == "A"]
    assert 0.8 < sum(len(r.loras) == 2 for r in a) / len(a) <= 1.0  # service A: 90% use 2 LoRAs
    assert 0.55 < sum(len(r.controlnets) > 0 for r in reqs) / len(reqs) < 0.85  # ~70% use ControlNet


@pytest.mark.parametrize("rate", [0.5, 3.0])
def test_sim_conserves_requests_caches_and_load_order(reqs, rate):
    p = SimProfile()
    q = scale_arrivals(reqs, rate, 1.0)
    for res in (simulate_katz(q, p, 5, 6, cn_cache=3, slots=2), simulate_diffusers(q, p, 16)):
        assert len(res.done) == res.arrived == len(q)  # every request served once
        assert res.max_cn_cache <= res.cn_capacity and res.max_lora_cache <= res.lora_capacity
        for d, r in zip(res.done, q):
            assert d.start >= r.t and d.end > d.start
            assert d.start >= d.cn_ready  # a ControlNet is never used before it has loaded


def test_lru_never_exceeds_capacity():
    c = LRUCache(3)
    for i in [1, 2, 3, 4, 1, 5, 2, 6, 6]:
        c.get(i, lambda: i)
        assert len(c) <= 3
    assert c.hits == 1 and list(c.items) == [5, 2, 6]


def test_e1_ratios_within_15_percent_of_artifact():
    p = SimProfile()
    for (c, l), (d_ref, k_ref) in ARTIFACT.items():
        q = _sequential(c, l)
        d = simulate_diffusers(q, p, 1, cn_cache=3, lora_cache=0, lora_source="local").done[-1].latency
        k = simulate_katz(q, p, 1, max(1, 2 * c), 20, lora_cache=0, lora_source="local", slots=1).done[-1].latency
        assert abs((d / k) / (d_ref / k_ref) - 1) <= 0.15, (c, l)


def test_bal_in_sim_k_bounds_stall():
    p = SimProfile()
    slow = p.katz_latency(0, 1, 0, 1.0)
    assert slow > p.katz_latency(0, 1, 20, 1.0) > p.katz_latency(0, 1, 40, 1.0) - 1e-9


def test_trace_replay_roundtrip_and_bad_rows(reqs, tmp_path):
    path = tmp_path / "t.json"
    save_addon_trace(reqs[:20], path)
    back = load_addon_trace(path)
    assert [r.loras for r in back] == [r.loras for r in reqs[:20]]
    recs = json.loads(path.read_text())
    del recs[3]["loras"]
    path.write_text(json.dumps(recs))
    with pytest.raises(ConfigError, match=r"workload.trace.file: row 3: field 'loras' is missing"):
        load_addon_trace(path)
    recs[3]["loras"] = ["x"]
    recs[5]["timestamp"] = -1
    path.write_text(json.dumps(recs))
    with pytest.raises(ConfigError, match=r"row 5: field 'timestamp'"):
        load_addon_trace(path)
