"""Sequence parallelism prices time as well as memory: the hybrid cost model (Malleus, checkpoint
recovery) and HotSPa's per-strategy costs read the same SP setting as their memory model."""
from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from impl.common.cost.varlen_model import StrategyLayout, seq_cost
from impl.common.hardware import load_hardware
from impl.common.megatron.derive import step_knobs
from impl.common.megatron.model import MegatronModel
from impl.common.megatron.step import layer_terms, theta_of
from impl.common.parallel.cost import HybridCostModel
from impl.common.workloads.hybrid import HybridWorkload


def _wl(sp: bool):
    raw = OmegaConf.load("conf/workload/hybrid_32b_dp4tp2pp4.yaml")
    wl = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HybridWorkload), raw))
    return dataclasses.replace(wl, memory=dataclasses.replace(wl.memory, sequence_parallel=sp))


def test_hybrid_layer_time_follows_the_memory_rows_sp_setting():
    hw = load_hardware("a800-80g")
    on, off = HybridCostModel.build(_wl(True), hw), HybridCostModel.build(_wl(False), hw)
    assert on.sequence_parallel and not off.sequence_parallel
    wl = _wl(True)
    rows = float(wl.micro_batch_size * wl.model.seq_len)
    m = MegatronModel.from_shape(wl.model)
    theta = theta_of(hw, step_knobs(hw))
    for tp in (2, 4):
        want = float(layer_terms(m, tp, rows, rows * wl.model.seq_len, hw, hw.gpus_per_node,
                                 sequence_parallel=True) @ theta)
        assert on.layer_time_s(tp) == pytest.approx(want, rel=1e-12)
        assert on.layer_time_s(tp) < off.layer_time_s(tp)  # norms and residuals on s / tp tokens
    assert on.layer_time_s(1) == off.layer_time_s(1)  # no TP, nothing to split


def test_seq_cost_reads_the_sp_setting():
    hw = load_hardware("a800-80g")
    raw = OmegaConf.load("conf/workload/hybrid_32b_dp4tp2pp4.yaml")
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HybridWorkload), raw)).model
    lay = StrategyLayout(1, 4, 1)
    sp, whole = seq_cost(model, lay, hw), seq_cost(model, lay, hw, sequence_parallel=False)
    assert sp.b < whole.b  # the per-token memory-bound work of norms and residuals, split by tp
