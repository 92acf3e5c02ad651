"""Shared fixtures: 7B strategies on 32 A800s priced by the step model (the default, derived) under
the shared step-model memory."""
from __future__ import annotations

import pytest

from impl.common.hardware import HardwareProfile, load_hardware
from impl.common.workloads.varlen import VarlenModelShape
from impl.hydraulis.cost.strategy import CostSpec, StrategyMemory, strategy_costs

LLAMA_7B = dict(name="llama-7b", num_layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=30592, seq_len=16384)


def hardware(name: str) -> HardwareProfile:
    return load_hardware(name)


@pytest.fixture(scope="session")
def a800():
    return hardware("a800-80g")


@pytest.fixture(scope="session")
def model7b():
    return VarlenModelShape(**LLAMA_7B)


@pytest.fixture(scope="session")
def mem7b(model7b, a800):
    return StrategyMemory.for_job(model7b, a800, 32)


@pytest.fixture(scope="session")
def costs7b(model7b, a800, mem7b):
    """(tp, pp) -> ReplicaCost, derived (the Megatron step model)."""
    return {(r.tp, r.pp): r for r in strategy_costs(model7b, a800, mem7b, CostSpec(), 32)}
