"""E3/E4 sweeps (impl/swiftdiffusion/README.md) at a small scale: the properties each sweep rests on."""
import pytest

from impl.common.traces.addons import AddonRequest, generate_addon_trace
from impl.common.workloads.diffusion_serving import AddonTraceSpec
from impl.swiftdiffusion.cache import LFUCache
from impl.swiftdiffusion.profile import SimProfile
from impl.swiftdiffusion.sim.sweeps import switches


def test_lfu_keeps_the_frequent_entry_and_capacity():
    c = LFUCache(2)
    for k in ["a", "a", "a", "b", "c", "b", "d", "a"]:
        c.get(k, lambda: True)
        assert len(c) <= 2
    assert "a" in c  # a (3 uses) survived every eviction; LRU would have dropped it at "d"
    assert c.hits == 3 and c.misses == 5


def test_switches_count_cache_misses_per_request():
    reqs = [AddonRequest(float(i), "A", "m", (), tuple(x)) for i, x in enumerate([["l1", "l2"], ["l1"], ["l3"], ["l1"]])]
    assert switches(reqs, "lru", 1, "lora") == pytest.approx(5 / 4)  # l1 l2 | l1 | l3 | l1
    assert switches(reqs, "lru", 2, "lora") == pytest.approx(3 / 4)  # l1 l2 | hit | l3 (evicts l2) | hit
    assert switches(reqs, "lfu", 1, "lora") == pytest.approx(5 / 4)


def test_e4_switches_fall_with_cache_size_and_lfu_not_worse_on_zipf():
    reqs = generate_addon_trace(AddonTraceSpec(num_requests=3000), 2)
    for kind in ("controlnet", "lora"):
        lru = [switches(reqs, "lru", c, kind) for c in (1, 4, 10)]
        lfu = [switches(reqs, "lfu", c, kind) for c in (1, 4, 10)]
        assert lru[0] >= lru[1] >= lru[2] and lfu[0] >= lfu[1] >= lfu[2]
        assert lfu[2] <= lru[2] + 1e-9  # skewed popularity: frequency beats recency
    assert switches(reqs, "lru", 10, "controlnet") < 0.3  # 10 hot ControlNets take 95% of calls


def test_e3_remote_bandwidth_and_k_move_katz_latency():
    p = SimProfile()
    slow = SimProfile(remote_bw_bytes_per_s=0.1e9)
    # a remote fetch of 3 s is longer than K=20 steps (0.6 s): BAL stalls for the rest
    assert slow.katz_latency(0, 2, 20, slow.remote_fetch_s) - p.katz_latency(0, 2, 20, p.remote_fetch_s) \
        == pytest.approx(slow.remote_fetch_s - p.remote_fetch_s)
    assert p.katz_latency(0, 2, 0, p.remote_fetch_s) > p.katz_latency(0, 2, 30, p.remote_fetch_s)


def test_e3_e4_scenarios_run_end_to_end_small(tmp_path):
    from impl.common.api import JobContext
    from impl.common.workloads.diffusion_serving import DiffusionServingWorkload
    from impl.swiftdiffusion.system import SwiftDiffusionSystem

    wl = DiffusionServingWorkload()
    wl.trace.num_requests = 150
    wl.sim.gpus = 8
    wl.sim.k_grid, wl.sim.remote_bw_grid, wl.sim.cn_cache_grid = [0, 20], [0.2e9, 0.8e9], [2, 8]
    wl.sim.cache_sizes = [1, 4]
    s = SwiftDiffusionSystem(SwiftDiffusionSystem.Config(plots=False, base_replicas=2), "swiftdiffusion")
    for sc in ("e3", "e4"):
        wl.sim.scenario = sc
        s.check("sim", wl, None, None)
        job = JobContext("sim", 0, "t", wl, "w", None, "h", None, "none", tmp_path)
        m = s.run(job).metrics
        if sc == "e3":
            assert m["k0_unloaded_mean_s"].value > m["k20_unloaded_mean_s"].value  # K=0: loads on the path
            assert m["bw0.8GBps_katz_unloaded_mean_s"].value <= m["bw0.2GBps_katz_unloaded_mean_s"].value
            assert {"split_b1_rps", "split_b2_rps"} <= set(m)  # b=3 leaves 2 pool GPUs: 4 slots < 3 ControlNets x 2
            assert "split_b3_rps" not in m
        else:
            assert m["lora_lru_c4_switches"].value <= m["lora_lru_c1_switches"].value
    s = SwiftDiffusionSystem(SwiftDiffusionSystem.Config(variant="nirvana"), "swiftdiffusion_nirvana")
    wl.sim.scenario = "e3"
    with pytest.raises(Exception, match=r"system.variant: E3 sweeps Katz"):
        s.check("sim", wl, None, None)
