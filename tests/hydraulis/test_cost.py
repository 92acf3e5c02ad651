"""Strategy prices and planning memory (README "One pricing path"): the derived
price is the step model's seq_cost, the cap the shared step-model memory's maxlen rounded to 128,
the authors' published tables an opt-in source, the fit path the same ReplicaCost."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from impl.common.api import ConfigError
from impl.common.cost.seqlen import fit_seq_cost
from impl.common.cost.varlen_model import StrategyLayout, MemoryModel, seq_cost
from impl.hydraulis.cost.strategy import (CAP_ROUND, CostSpec, ReplicaCost, StrategyMemory, strategy_cost,
                                 strategy_costs)

from .conftest import hardware
from impl.common.megatron.derive import step_knobs


def test_derived_cost_is_the_step_models_seq_cost_in_ms(model7b, a800, mem7b, costs7b):
    """Every strategy, even and uneven layer splits, is exactly seq_cost of its slowest stage."""
    assert {(1, 4), (2, 2), (4, 1), (8, 1), (16, 1), (4, 4)} <= set(costs7b)
    for (tp, pp), r in costs7b.items():
        sc = seq_cost(model7b, StrategyLayout(1, tp, pp), a800)
        assert (r.a, r.b, r.c) == pytest.approx((sc.a * 1e3, sc.b * 1e3, sc.c * 1e3), rel=1e-12), (tp, pp)
    r = strategy_cost(model7b, a800, mem7b, CostSpec(), 4, 3)  # 32 layers over 3 stages: 11 on the slowest
    sc = seq_cost(model7b, StrategyLayout(1, 4, 3), a800)
    assert (r.a, r.b, r.c) == pytest.approx((sc.a * 1e3, sc.b * 1e3, sc.c * 1e3), rel=1e-12)
    # the step model's own terms: per-layer overhead in c, more TP = less work per GPU
    k = step_knobs(a800)
    assert costs7b[(8, 1)].c >= 32 * k.layer_overhead_s * 1e3
    assert costs7b[(8, 1)].mb_time([8000]) < costs7b[(4, 1)].mb_time([8000])


def test_layer_overhead_knob_moves_the_derived_constant(model7b):
    """The hardware's fitted per-layer overhead is what a strategy's c is made of (the knob the
    sensitivity preset sweeps): doubling it adds 32 x the old value per micro-batch on (4,1)."""
    hw = hardware("a800-80g-megatron")
    k = hw.megatron.knobs
    hw2 = hw.with_megatron(knobs=dataclasses.replace(k, layer_overhead_s=2 * k.layer_overhead_s))
    mem, mem2 = StrategyMemory.for_job(model7b, hw, 16), StrategyMemory.for_job(model7b, hw2, 16)
    r, r2 = (strategy_cost(model7b, h, m, CostSpec(), 4, 1) for h, m in ((hw, mem), (hw2, mem2)))
    assert r2.c - r.c == pytest.approx(32 * k.layer_overhead_s * 1e3, rel=1e-6)
    assert r2.b == pytest.approx(r.b) and r2.a == pytest.approx(r.a)


def test_cap_is_the_shared_memory_models_maxlen_rounded_to_128(model7b, a800, costs7b):
    shared = MemoryModel.for_hardware(a800, zero1=True, sequence_parallel=True)
    mem = StrategyMemory.for_job(model7b, a800, 32)
    assert mem.capacity_bytes == shared.capacity_bytes < a800.memory_bytes
    for (tp, pp), r in costs7b.items():
        ml = shared.maxlen(model7b, StrategyLayout(32 // (tp * pp), tp, pp), 32)
        assert r.cap == ml // CAP_ROUND * CAP_ROUND and r.cap % CAP_ROUND == 0 and r.cap >= CAP_ROUND, (tp, pp)
        assert mem.fits(tp, pp, r.cap) and mem.fits(tp, pp, ml) and not mem.fits(tp, pp, ml + 1), (tp, pp)
    # more TP or PP = fewer states and activations per GPU = a longer micro-batch
    assert costs7b[(1, 4)].cap < costs7b[(4, 1)].cap < costs7b[(8, 1)].cap < costs7b[(16, 1)].cap


def test_optimizer_is_sharded_over_every_gpu_of_the_job(model7b, a800):
    """Disaggregation: the optimizer states live in the optimizer layout, spread over all N GPUs, so a
    bigger job leaves more room for activations on the same strategy."""
    m16, m64 = StrategyMemory.for_job(model7b, a800, 16), StrategyMemory.for_job(model7b, a800, 64)
    assert m64.maxlen(4, 1) > m16.maxlen(4, 1)
    d = m16.bytes_at(4, 1, 1000) - m64.bytes_at(4, 1, 1000)
    st = m16.shared.state_bytes(model7b, StrategyLayout(4, 4, 1), 16)["optimizer_bytes"]
    assert d == pytest.approx(st * (1 - 16 / 64), rel=1e-9)


def test_strategy_that_cannot_hold_128_tokens_is_dropped(model7b):
    """7B on 16 A100-40G: TP1 x PP1 holds the whole model's params and grads (6 B x 6.7B params >
    the allocatable 27 GiB), so no micro-batch fits; (1,2) still holds some."""
    hw = hardware("a100-40g-megatron")
    mem = StrategyMemory.for_job(model7b, hw, 16)
    assert mem.maxlen(1, 1) < CAP_ROUND and mem.cap(1, 1) == 0
    assert strategy_cost(model7b, hw, mem, CostSpec(), 1, 1) is None
    got = {(r.tp, r.pp): r for r in strategy_costs(model7b, hw, mem, CostSpec(), 16)}
    assert (1, 1) not in got and got[(1, 2)].cap >= CAP_ROUND
    assert all(r.cap >= CAP_ROUND for r in got.values())


def test_zero3_memory_shards_params_and_grads_too(model7b, a800):
    """DeepSpeed-like's ZeRO-3 + Ulysses: the same shared terms with params and grads over N."""
    mem = StrategyMemory.for_job(model7b, a800, 16)
    st = mem.shared.state_bytes(model7b, StrategyLayout(8, 2, 1, "ulysses"), 16)
    d = mem.bytes_at(2, 1, 4096, "ulysses", zero=1) - mem.bytes_at(2, 1, 4096, "ulysses", zero=3)
    assert d == pytest.approx((st["params_bytes"] + st["grads_bytes"]) * 15 / 16, rel=1e-9)
    assert mem.maxlen(2, 1, "ulysses", zero=3) > mem.maxlen(2, 1, "ulysses", zero=1)
    assert mem.fits(2, 1, mem.maxlen(2, 1, "ulysses", 3), "ulysses", 3)
    assert not mem.fits(2, 1, mem.maxlen(2, 1, "ulysses", 3) + 1, "ulysses", 3)
    with pytest.raises(ConfigError, match="ZeRO-3 memory: only pp = 1"):
        mem.maxlen(2, 2, zero=3)


def test_published_tables_are_an_opt_in_source(model7b, a800, mem7b, costs7b):
    pub = {(r.tp, r.pp): r for r in strategy_costs(model7b, a800, mem7b, CostSpec(source="published"), 32)}
    assert set(pub) == {(1, 4), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1), (8, 2), (16, 1)}
    r = pub[(8, 2)]
    assert (r.a, r.b, r.c, r.util) == (2.54e-7, 1.85e-2, 23.0, 1024)
    assert r.seq_cost(1000) == pytest.approx(2.54e-7 * 1e6 + 18.5)
    assert r.mb_time([1000, 24]) == pytest.approx(r.seq_cost(1000) + r.seq_cost(24) + 23.0)
    # the default is the step model, not the table; the memory (cap) is the same either way
    assert CostSpec().source == "derived" and costs7b[(8, 2)].b != r.b
    assert all(pub[k].cap == costs7b[k].cap for k in pub)


def test_a100_40g_published_table_and_util(model7b):
    hw = hardware("a100-40g")
    mem = StrategyMemory.for_job(model7b, hw, 16)
    got = {(r.tp, r.pp): r for r in strategy_costs(model7b, hw, mem, CostSpec(source="published"), 16)}
    # the full pool of ten strategies of the authors' generate_strategy_7b_A100.py, less those that
    # cannot hold 128 tokens under the step model's memory
    pool = {(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)}
    assert set(got) <= pool and (8, 1) in got and (1, 8) in got
    assert got[(8, 1)].util == 4352 and got[(8, 1)].c == 59.6554 and got[(1, 8)].a == 4.59723501e-7


def test_fit_path_feeds_the_same_replica_cost():
    """Real mode fits a SeqCost in seconds; the planner consumes it in ms."""
    s = np.array([64, 128, 256, 512, 1024, 2048], dtype=float)
    t = 2e-9 * s * s + 3e-5 * s + 4e-3
    rc = ReplicaCost.from_seq_cost(1, 1, fit_seq_cost(s, t), cap=2048, util=64)
    assert rc.a == pytest.approx(2e-6) and rc.b == pytest.approx(3e-2) and rc.c == pytest.approx(4.0)


def test_unknown_source_and_missing_published_table_are_one_line(model7b, a800, mem7b):
    for bad in ("x", "auto"):  # auto (published where a table exists) is gone: one pricing path
        with pytest.raises(ConfigError) as e:
            strategy_cost(model7b, a800, mem7b, CostSpec(source=bad), 1, 4)
        assert str(e.value) == f"system.sim.cost.source: unknown {bad!r} (one of: derived, published)"
    m13 = dataclasses.replace(model7b, name="llama-13b")
    with pytest.raises(ConfigError) as e:
        strategy_cost(m13, a800, mem7b, CostSpec(source="published"), 1, 4)
    assert str(e.value) == ("system.sim.cost.source: no published coefficients for llama-13b on 80gb GPUs "
                            "(only llama-7b); use derived")
