"""Real mode's max_tokens by the profile_memory rule on a per-rank budget (Hetu `examples/lobra/scripts/profile_memory.py`)."""
import pytest
from omegaconf import OmegaConf

from bench.validate import typed_workload
from impl.common.api import ConfigError
from impl.lobra.real_memory import caps_from_budget, profile_memory

LENGTHS = (64, 128, 256)


@pytest.fixture(scope="module")
def mem():
    wl = typed_workload(OmegaConf.load("conf/workload/lobra_cpu.yaml"))
    return profile_memory(wl.model, 2, 4, LENGTHS)


def test_checkpointing_holds_more_tokens_in_the_same_bytes(mem):
    rs, rl = mem["R_S"].peak_bytes, mem["R_L"].peak_bytes
    assert mem["R_S"].states_bytes == mem["R_L"].states_bytes > 0
    for a, b in zip(LENGTHS, LENGTHS[1:]):
        assert rs[a] < rs[b] and rl[a] < rl[b]  # activations grow with the tokens
    for s in LENGTHS:
        assert rl[s] < rs[s]
    # R_S keeps at least every layer's fp32 input hidden state (L x s x h x 4 B), and at these
    # sizes its saves are linear in s: the bytes per token added from 128 to 256 equal those
    # added from 64 to 128
    wl = typed_workload(OmegaConf.load("conf/workload/lobra_cpu.yaml"))
    act = {s: rs[s] - mem["R_S"].states_bytes for s in LENGTHS}
    for s in LENGTHS:
        assert act[s] >= wl.model.num_layers * s * wl.model.hidden * 4
    assert (act[256] - act[128]) / 2 == pytest.approx(act[128] - act[64], rel=0.1)
    budget = (rs[128] + rs[256]) / 2  # R_S holds 128, R_L more
    caps = caps_from_budget(mem, max(budget, rl[256]))
    assert caps["R_S"] == 128 and caps["R_L"] == 256


def test_budget_below_the_shortest_is_one_line(mem):
    with pytest.raises(ConfigError, match=r"system.real.memory_budget_bytes: 1000 B holds no profiled length on R_S"):
        caps_from_budget(mem, 1000.0)
