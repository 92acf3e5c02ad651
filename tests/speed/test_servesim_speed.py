"""Serving-simulator speed: 1,000 requests on one server (target < 5 s; see the benchmark table)."""
import pathlib

from impl.caraserve.sim import build_cost, simulate_policy
from impl.caraserve.system import ServingSystem
from impl.common.api import JobContext
from impl.common.hardware import HardwareProfile
from impl.common.workloads.serving import ServingTrace, ServingWorkload


def test_servesim_1000_requests_one_server(benchmark, tmp_path):
    hw = HardwareProfile(name="a10", peak_flops={"fp16": 125e12}, memory_bw_bytes_per_s=600e9,
                         host_link_bw_bytes_per_s=32e9, intra_node_bw_bytes_per_s=32e9)
    wl = ServingWorkload(trace=ServingTrace(num_requests=1000, rate_rps=5.0))
    job = JobContext(mode="sim", seed=0, experiment="t", workload=wl, workload_name="t", hardware=hw,
                     hardware_name="a10", fault=None, fault_name="none", out_dir=pathlib.Path(tmp_path),
                     show_progress=False)
    s = ServingSystem(ServingSystem.Config(plots=False), "caraserve")
    trace, cost = s.trace(job), build_cost(s, job)
    res, _ = benchmark.pedantic(simulate_policy, args=(s, job, trace, cost, "caraserve", "rank_aware"),
                                rounds=1, iterations=1)
    assert len(res.records) == 1000
