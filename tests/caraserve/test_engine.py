"""Real engine invariants: CPU/device switch at any layer is bit-identical; no adapter is used
before it is loaded; completed + dropped = arrived for every policy."""
from __future__ import annotations

import pytest
import torch

from impl.caraserve.cpu_prefill import CPULoRAWorker
from impl.common.llm.serving_engine import EngineRequest, ServingEngine, run_alone
from impl.common.llm.forward import InlineCPU
from impl.common.llm.lora import LoRABatch
from impl.common.llm.pool import AdapterNotResident, AdapterPool
from impl.caraserve.policies import serving
from impl.common.llm.scheduler import SchedulerConfig

PROMPT = [5 + (7 * i) % 250 for i in range(19)]


def _same(a, b):
    la, ta, ca = a
    lb, tb, cb = b
    assert torch.equal(la, lb)
    assert ta == tb
    for (ka, va), (kb, vb) in zip(ca.layers, cb.layers):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_switch_at_any_layer_boundary_is_identical(tiny):
    base, ads = tiny
    ref = run_alone(base, ads, "a64", PROMPT, 4)
    cpu = InlineCPU(ads)
    for switch in range(base.config.num_hidden_layers + 1):
        _same(run_alone(base, ads, "a64", PROMPT, 4, switch_layer=switch, cpu=cpu), ref)
    assert cpu.jobs == 2 * sum(range(base.config.num_hidden_layers + 1))  # 2 LoRA inputs per CPU layer
    assert not torch.equal(ref[0], run_alone(base, ads, None, PROMPT, 1)[0])  # the adapter matters


@pytest.mark.real
def test_cpu_worker_process_matches_device_path(tiny, tmp_path):
    base, ads = tiny
    ref = run_alone(base, ads, "a32", PROMPT, 3)
    with CPULoRAWorker(ads, tmp_path, max_rows=64) as w:
        _same(run_alone(base, ads, "a32", PROMPT, 3, switch_layer=2, cpu=w), ref)
        assert w.jobs == 4


def test_device_path_refuses_unloaded_adapter(tiny):
    base, ads = tiny
    pool = AdapterPool(2, 2)
    pool.acquire("a16")
    b = LoRABatch(adapters=[ads["a16"]], row_adapter=torch.zeros(3, dtype=torch.long), segments=[(0, 3)],
                  device_check=lambda s, layer: pool.check_resident("a16", layer // 2))
    with pytest.raises(AdapterNotResident, match="adapter 'a16' layer group 0 used before its load completed"):
        b.apply(0, "q_proj", torch.zeros(3, 64), torch.zeros(3, 64))
    pool.get("a16").ready[0] = True
    b.apply(1, "q_proj", torch.zeros(3, 64), torch.zeros(3, 64))
    with pytest.raises(AdapterNotResident):
        b.apply(2, "q_proj", torch.zeros(3, 64), torch.zeros(3, 64))


def _reqs(names):
    return [EngineRequest(rid=i, arrival_s=0.002 * i, adapter=n, prompt=PROMPT[: 6 + i % 5], output_len=3)
            for i, n in enumerate(names)]


@pytest.mark.parametrize("policy", ["cached", "ondmd", "caraserve", "slora", "punica", "dlora"])
def test_engine_policies_serve_every_request(tiny, policy):
    base, ads = tiny
    names = ["a16", "a32", "a64", "a16", "b16", "a16", "a16", "a16"]
    cfg = SchedulerConfig(policy=serving(policy), max_batch=4, pool_slots=2, load_groups=2, dlora_merge_min=3)
    eng = ServingEngine(base, ads, cfg, seconds_for=lambda a: 0.004)  # residency checked on every layer
    try:
        st = eng.serve(_reqs(names))
    finally:
        eng.close()
    assert len(st.records) + st.dropped == st.arrived == len(names)
    assert sorted(r.rid for r in st.records) == list(range(len(names)))
    if policy == "caraserve":
        # prefills never wait for a load; a decode step may wait for the rest of a load that its
        # request's prefill outran (ServingPolicy.decode_waits_for_load), never longer than the loads
        assert st.cpu_layers > 0 and st.stall_s < 0.004 * st.loads
    if policy == "ondmd":
        assert st.stall_s > 0


def test_engine_greedy_tokens_match_a_lone_request(tiny):
    base, ads = tiny
    eng = ServingEngine(base, ads, SchedulerConfig(policy=serving("caraserve"), pool_slots=2, load_groups=2),
                        seconds_for=lambda a: 0.01)
    req = EngineRequest(rid=0, arrival_s=0.0, adapter="a64", prompt=PROMPT, output_len=4)
    captured = {}
    orig = eng._run

    def spy(plan, stats):
        orig(plan, stats)
        for r in plan.reqs:
            captured[r.rid] = list(r.data["tokens"])

    eng._run = spy
    try:
        eng.serve([req])
    finally:
        eng.close()
    assert captured[0] == run_alone(base, ads, "a64", PROMPT, 4)[1]


def test_unknown_adapter_id_is_one_line(tiny):
    base, ads = tiny
    eng = ServingEngine(base, ads, SchedulerConfig(policy=serving("cached")))
    try:
        with pytest.raises(KeyError, match="request 0: unknown adapter id 'nope'"):
            eng.serve([EngineRequest(0, 0.0, "nope", [5, 6], 2)])
    finally:
        eng.close()


def test_decode_batch_profile_times_every_size_even_beyond_the_adapters(tiny):
    from impl.common.llm.serving_engine import time_decode_batches

    base, ads = tiny
    out = time_decode_batches(base, ads, ["a16", "a64"], PROMPT, [4, 1, 2], "bgmv", reps=1)
    assert sorted(out) == [1, 2, 4] and all(t > 0 for t in out.values())


def test_cpu_assisted_prefill_profile_pairs_a_cold_prefill_with_the_resident_one(tiny):
    from impl.common.llm.serving_engine import time_cpu_assisted_prefills

    base, ads = tiny
    cfg = SchedulerConfig(policy=serving("caraserve"), pool_slots=2, load_groups=2)
    cpu = InlineCPU(ads)
    # a copy longer than the prefill: the cold one runs its first layer group on the CPU path
    out = time_cpu_assisted_prefills(base, ads, cfg, ["a16", "a64"], PROMPT, lambda a: 0.05, cpu, reps=2, idle_s=0.001)
    assert [p["adapter"] for p in out] == ["a16", "a64", "a16", "a64"]
    assert all(p["cpu_layers"] >= 1 and p["cold_s"] > 0 and p["warm_s"] > 0 for p in out)
    assert cpu.jobs == 2 * sum(p["cpu_layers"] for p in out)  # only the cold prefills used the CPU path
