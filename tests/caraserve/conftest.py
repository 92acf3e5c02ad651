from __future__ import annotations

import copy

import pytest
import torch

from impl.common.llm.lora import AdapterSpec, adapters_from_peft, make_peft_model
from impl.common.llm.model import LlamaShape, build_llama

SHAPE = LlamaShape(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=300)


@pytest.fixture(scope="session")
def tiny():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    base = build_llama(SHAPE, seed=0)
    specs = [AdapterSpec(f"a{r}", r) for r in (16, 32, 64)] + [AdapterSpec("b16", 16)]
    ads = adapters_from_peft(make_peft_model(copy.deepcopy(base), specs, seed=2))
    yield base, ads
    torch.set_num_threads(old)
