from __future__ import annotations

import copy

import pytest
import torch

from impl.common.llm.lora import AdapterSpec, adapters_from_peft, make_peft_model
from impl.common.llm.model import build_llama
from impl.common.workloads.serving import LlamaShape

SHAPE = LlamaShape(hidden=64, ffn_hidden=128, num_layers=4, heads=4, kv_heads=4, vocab=300)


@pytest.fixture(scope="session")
def tiny():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    base = build_llama(SHAPE, seed=0)
    specs = [AdapterSpec(f"a{r}", r) for r in (16, 32, 64)] + [AdapterSpec("b16", 16)]
    ads = adapters_from_peft(make_peft_model(copy.deepcopy(base), specs, seed=2))
    yield base, ads
    torch.set_num_threads(old)
