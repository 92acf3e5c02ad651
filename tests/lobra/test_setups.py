"""LobRA on the authors' setups (Hetu `examples/lobra` scripts): the calibrated step model's LoRA pricing, the
profile_memory rule for max_tokens, table deployments, the per-step overhead, filtered lengths."""
import dataclasses

import numpy as np
import pytest
from omegaconf import OmegaConf

from bench.validate import typed_hardware, typed_workload
from impl.common.api import ConfigError
from impl.common.cost.varlen_model import StrategyLayout, seq_cost
from impl.common.varlen.lengths import LengthDist
from impl.lobra import datasets
from impl.lobra.sim import simulate
from impl.lobra.cost.step_model import SimCostKnobs, max_tokens, peak_bytes, memory_model, pp_degrees, tp_cost
from impl.lobra.system import LobRA, LobRASimKnobs, ReplicaRow


@pytest.fixture(scope="module")
def hw_cal():
    return typed_hardware(OmegaConf.load("conf/hardware/a800-80g-megatron.yaml"))


@pytest.fixture(scope="module")
def hw_sheet():
    return typed_hardware(OmegaConf.load("conf/hardware/a100-40g.yaml"))


@pytest.fixture(scope="module")
def wl7():
    wl = typed_workload(OmegaConf.create(datasets.workload_yaml("llama2-7b", 16, ["dolly", "MeetingBank"], steps=2)))
    for t in wl.tasks:
        t.batch_seqs = 24
    return wl


def test_calibrated_lora_cost_is_the_step_model_with_two_thirds_gemms(hw_cal):
    m = typed_workload(OmegaConf.create(datasets.workload_yaml("llama2-70b", 64, ["dolly"]))).model
    for tp, pp in [(1, 4), (8, 1), (16, 1)]:
        full = tp_cost(m, tp, pp, hw_cal, SimCostKnobs(lora_matrix_factor=1.0))
        lora = tp_cost(m, tp, pp, hw_cal, SimCostKnobs())
        sc = seq_cost(m, StrategyLayout(1, tp, pp), hw_cal)
        per = m.num_layers / pp
        # factor 1: exactly the calibrated step model's stage cost (the plain path)
        assert full.f(3, 2048) * per == pytest.approx(3 * 2048 * sc.b + 3 * 2048 ** 2 * sc.a + sc.c, rel=1e-12)
        # LoRA drops a third of the GEMM work and nothing else: cheaper; the per-micro-batch
        # constant moves only by the GEMMs' share of the chord's intercept (the step model's table
        # GEMMs are not affine in the rows)
        assert lora.f(3, 2048) < full.f(3, 2048)
        assert lora.c[0] == pytest.approx(full.c[0], rel=0.01)
    # TP 16 spans two nodes: its collectives go over the fitted inter-node bus, so doubling TP8
    # does not halve a micro-batch's time.
    t8 = tp_cost(m, 8, 1, hw_cal, SimCostKnobs()).f(1, 8192)
    t16 = tp_cost(m, 16, 1, hw_cal, SimCostKnobs()).f(1, 8192)
    assert t16 > t8 / 2


@pytest.mark.parametrize("profile", ["a800-80g-megatron", "a100-40g"])
def test_max_tokens_is_the_profile_rule(profile):
    hw = typed_hardware(OmegaConf.load(f"conf/hardware/{profile}.yaml"))
    m = typed_workload(OmegaConf.create(datasets.workload_yaml("llama2-70b", 64, ["dolly"]))).model
    k = SimCostKnobs()
    room = memory_model(hw, k).capacity_bytes
    assert pp_degrees(m) == [1, 2, 4, 5, 8]
    seen = set()
    for tp in (1, 2, 4, 8, 16):
        for pp in pp_degrees(m):
            got = max_tokens(m, tp, pp, hw, k, 12, 16, 16384)
            seen.add(got)
            fits = [s for s in k.profile_lengths if peak_bytes(m, tp, pp, hw, k, 12, 16, s) <= room]
            assert got == (max(fits) if fits else 0)
            assert got in (0,) + tuple(k.profile_lengths)
            nxt = [s for s in k.profile_lengths if s > got]
            if nxt:  # the next length does not run
                assert peak_bytes(m, tp, pp, hw, k, 12, 16, nxt[0]) > room
    assert len(seen) >= 3  # the rule separates configs, not one cap for all


def _sys(**kw):
    # the knobs go in at construction, where the config checks them
    sim = LobRASimKnobs(**kw.pop("sim", {}))
    cfg = LobRA.Config(**{**kw, "ilp_time_limit_s": 2.0}, sim=sim)
    return LobRA(cfg, kw.get("policy", "lobra"))


ROW = ReplicaRow(gpus=16, replicas=[[6, 1, 1, 2048], [1, 2, 1, 4096], [1, 8, 1, 16384]])


def test_table_deployment_and_its_errors(wl7, hw_cal):
    s = _sys(sim={"replica_table": [ROW]})
    _, info = simulate(s, wl7, typed_hardware(OmegaConf.load("conf/hardware/a100-40g-megatron.yaml")), 0)
    assert info["deployment_kind"] == "table"
    assert [d.split("(")[0] for d in info["deployment"]] == ["6xTP1", "1xTP2", "1xTP8"]
    assert [r["max_tokens_table"] for r in info["replica_table"]["max_tokens"]] == [2048, 4096, 16384]
    theirs = _sys(sim={"replica_table": [ROW], "max_tokens_from": "table"})
    _, ti = simulate(theirs, wl7, typed_hardware(OmegaConf.load("conf/hardware/a100-40g-megatron.yaml")), 0)
    assert [d.split("(")[1] for d in ti["deployment"]] == ["2048)", "4096)", "16384)"]
    # no matching row: auto plans; an explicit table deployment refuses
    _, pi = simulate(_sys(sim={"replica_table": [dataclasses.replace(ROW, gpus=32, replicas=[[4, 8, 1, 16384]])]}),
                     wl7, hw_cal, 0)
    assert pi["deployment_kind"] == "planned"
    with pytest.raises(ConfigError, match=r"system.sim.replica_table: no row for 16 GPUs and 2 tasks"):
        simulate(_sys(deployment="table"), wl7, hw_cal, 0)
    with pytest.raises(ConfigError, match=r"system.sim.replica_table\[0\]: replicas use 15 GPUs, the row says 16"):
        _sys(sim={"replica_table": [ReplicaRow(gpus=16, replicas=[[7, 1, 1, 2048], [1, 8, 1, 16384]])]})
    with pytest.raises(ConfigError, match="system.sim.max_tokens_from: unknown value 'x'"):
        _sys(sim={"max_tokens_from": "x"})


def test_step_overhead_is_the_fitted_iteration_overhead(wl7, hw_cal):
    on, info = simulate(_sys(policy="task_fused"), wl7, hw_cal, 0)
    off, _ = simulate(_sys(policy="task_fused", sim={"step_overhead_s": 0.0}), wl7, hw_cal, 0)
    from impl.common.megatron.step import optimizer_step_s
    from impl.lobra.cost.step_model import lora_params_per_layer

    # every training system's per-iteration rule: Adam over the tasks' adapters + the fitted overhead
    lora = lora_params_per_layer(wl7.model, wl7.lora_rank) * wl7.model.num_layers * len(wl7.tasks)
    k = optimizer_step_s(float(lora), 1, hw_cal)
    assert info["step_overhead_s"] == k > hw_cal.megatron.knobs.iteration_overhead_s
    assert on["gpu_seconds"].value - off["gpu_seconds"].value == pytest.approx(wl7.num_gpus * k * wl7.steps)
    seq_on, _ = simulate(_sys(policy="task_sequential"), wl7, hw_cal, 0)
    seq_off, _ = simulate(_sys(policy="task_sequential", sim={"step_overhead_s": 0.0}), wl7, hw_cal, 0)
    # Task-Sequential steps once per task
    assert seq_on["gpu_seconds"].value - seq_off["gpu_seconds"].value == pytest.approx(
        wl7.num_gpus * k * wl7.steps * len(wl7.tasks))


def test_resampled_lengths_are_the_filtered_distribution():
    d = LengthDist(kind="lognormal", median=120.0, sigma=1.05, min_len=256, max_len=8192, clip=False, resample=True)
    x = d.sample(20000, np.random.default_rng(0))
    assert x.min() >= 256 and x.max() <= 8192 and len(x) == 20000
    assert np.array_equal(x, d.sample(20000, np.random.default_rng(0)))
    raw = np.rint(np.random.default_rng(1).lognormal(np.log(120.0), 1.05, 400000))
    kept = raw[(raw >= 256) & (raw <= 8192)]
    assert abs(x.mean() / kept.mean() - 1) < 0.03  # the conditional distribution, not a clip
    clipped = dataclasses.replace(d, clip=True, resample=False).sample(20000, np.random.default_rng(0))
    assert (clipped == 256).mean() > 0.5 and (x == 256).mean() < 0.01
    with pytest.raises(ConfigError, match=r"workload.lengths: \[60000, 70000\] holds under 1e-4"):
        dataclasses.replace(d, min_len=60000, max_len=70000).sample(10, np.random.default_rng(0))
