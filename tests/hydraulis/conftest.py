"""Shared fixtures: the published 7B costs under the 32-GPU optimizer layout of spec 2.1."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from impl.common.hardware import HardwareProfile
from impl.common.workloads.varlen import VarlenModelShape
from impl.hydraulis.cost import CostSpec, MemoryModel, OptLayout, strategy_costs

LLAMA_7B = dict(name="llama-7b", num_layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=30592)


def hardware(name: str) -> HardwareProfile:
    return HardwareProfile(**OmegaConf.to_container(OmegaConf.load(f"conf/hardware/{name}.yaml")))


@pytest.fixture(scope="session")
def a800():
    return hardware("a800-80g")


@pytest.fixture(scope="session")
def model7b():
    return VarlenModelShape(**LLAMA_7B)


@pytest.fixture(scope="session")
def mem7b(model7b, a800):
    return MemoryModel.for_model(model7b, a800.memory_bytes, OptLayout(8, 4, 1))


@pytest.fixture(scope="session")
def costs7b(model7b, a800, mem7b):
    """(tp, pp) -> ReplicaCost from the published 80 GB table."""
    return {(r.tp, r.pp): r for r in strategy_costs(model7b, a800, mem7b, CostSpec(), 32)}
