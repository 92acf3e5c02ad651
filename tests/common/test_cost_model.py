"""Closed-form transformer and communication costs (spec adaptra §6)."""
import math

import pytest

from impl.common.api import ConfigError
from impl.common.cost import (
    LinkCosts,
    StageCosts,
    activation_msg_bytes,
    bytes_per_elem,
    dp_allreduce_time_s,
    forward_flops_per_layer,
    layer_params,
    layer_split,
    model_params,
    p2p_time_s,
    ring_allreduce_time_s,
    same_node,
    stage_costs,
    stage_grad_bytes,
    tp_allreduce_time_s,
)
from impl.common.hardware import HardwareProfile
from impl.common.workloads.pipeline import ModelShape


@pytest.fixture
def h800() -> HardwareProfile:
    # Spec §6 figures: H800 = H100 (989 TF fp16 dense) with 400 GB/s NVLink; 400 Gb/s IB; PCIe5 50 GB/s.
    return HardwareProfile(name="h800-spec", source="spec adaptra §6", peak_flops={"fp16": 989e12},
                           mfu=0.4, gpus_per_node=8, intra_node_bw_bytes_per_s=400e9,
                           intra_node_latency_s=5e-6, inter_node_bw_bytes_per_s=400e9 / 8,
                           inter_node_latency_s=10e-6, host_link_bw_bytes_per_s=50e9, comm_efficiency=0.8)


def gpt14b() -> ModelShape:
    return ModelShape(name="gpt-14b", num_layers=46, hidden=5120, heads=40, vocab=50257, seq_len=1024)


def test_forward_flops_matches_spec_formula():
    b, s, h = 2, 1024, 5120
    assert forward_flops_per_layer(b, s, h) == 24 * b * s * h * h + 4 * b * s * s * h


def test_14b_on_8_h800_stages_is_about_10ms_forward(h800):
    costs = stage_costs(gpt14b(), stages=8, micro_batch_size=1, dtype="fp16", tp=1, hw=h800)
    assert costs.layers == (6, 6, 6, 6, 6, 6, 5, 5)
    assert max(costs.tf_s) == pytest.approx(10e-3, rel=0.05)
    # B ≈ W ≈ F without TP communication.
    assert costs.tb_s == costs.tf_s and costs.tw_s == costs.tf_s
    assert costs.tf_s[7] == pytest.approx(costs.tf_s[0] * 5 / 6)


def test_layer_split_gives_extra_layers_to_first_stages():
    assert layer_split(22, 4) == (6, 6, 5, 5)
    assert layer_split(8, 8) == (1,) * 8
    with pytest.raises(ConfigError, match="6 stages cannot split 4 layers"):
        layer_split(4, 6)


def test_bytes_and_params():
    assert activation_msg_bytes(1, 1024, 5120, "fp16") == 1024 * 5120 * 2
    assert bytes_per_elem("fp32") == 4
    with pytest.raises(ConfigError, match="dtype 'int3'"):
        bytes_per_elem("int3")
    h = 768
    assert layer_params(h) == 12 * h * h + 13 * h
    m = ModelShape(num_layers=12, hidden=h, vocab=50257, seq_len=1024)
    assert model_params(m) == pytest.approx(124e6, rel=0.01)  # GPT-2 small
    assert sum(stage_grad_bytes(m, 4, "fp16")) == 12 * layer_params(h) * 2


def test_ring_allreduce_and_tp_costs(h800):
    assert ring_allreduce_time_s(1e9, 1, 1e9, 1e-3) == 0.0
    assert ring_allreduce_time_s(1e9, 4, 1e9, 1e-3) == pytest.approx(2 * 3 / 4 + 1e-3)
    m = gpt14b()
    base = stage_costs(m, 8, 1, "fp16", 1, h800)
    tp2 = stage_costs(m, 8, 1, "fp16", 2, h800)
    ar = tp_allreduce_time_s(1, m.seq_len, m.hidden, "fp16", 2, h800)
    nbytes = 1024 * 5120 * 2
    assert ar == pytest.approx(2 * 1 / 2 * nbytes / (400e9 * 0.8) + 5e-6)
    # W halves with TP and pays no collective; F and B also pay two all-reduces per layer.
    assert tp2.tw_s[0] == pytest.approx(base.tw_s[0] / 2)
    assert tp2.tf_s[0] == pytest.approx(base.tf_s[0] / 2 + 6 * 2 * ar)
    assert tp2.tb_s == tp2.tf_s


def test_p2p_placement(h800):
    nbytes = 1024 * 5120 * 2
    # tp=dp=1, 8 GPUs per node: stages 0..7 share node 0, stage 8 is on node 1.
    assert same_node(0, 1, 1, 1, 8) and not same_node(7, 8, 1, 1, 8)
    assert p2p_time_s(0, 1, nbytes, h800) == pytest.approx(5e-6 + nbytes / (400e9 * 0.8))
    assert p2p_time_s(7, 8, nbytes, h800) == pytest.approx(10e-6 + nbytes / (50e9 * 0.8))
    # tp·dp = 8 fills a node per stage: every pipeline link crosses nodes.
    assert not same_node(0, 1, 4, 2, 8)
    # tp·dp = 2: four stages per node.
    assert same_node(2, 3, 2, 1, 8) and not same_node(3, 4, 2, 1, 8)
    links = LinkCosts.from_hardware(16, nbytes, h800)
    assert len(links.p2p_s) == 15 and links.p2p_s[7] > links.p2p_s[6]
    assert links.copy_s == pytest.approx(nbytes / 50e9)


def test_dp_allreduce_gated_by_slow_link():
    base = dp_allreduce_time_s(1e9, 4, 1e10, 0.0)
    assert base == pytest.approx(2 * 3 / 4 * 0.1)
    assert dp_allreduce_time_s(1e9, 4, 1e10, 0.0, slow_link_delay_s=0.03) == pytest.approx(base + 6 * 0.03)
    assert dp_allreduce_time_s(1e9, 1, 1e10, 0.0, 0.03) == 0.0


def test_stage_costs_validation():
    with pytest.raises(ConfigError, match="tb_s must be >= 0"):
        StageCosts((1.0,), (-1.0,), (1.0,))
    with pytest.raises(ConfigError, match="lengths 2/1/1"):
        StageCosts((1.0, 1.0), (1.0,), (1.0,))
    with pytest.raises(ConfigError, match="p2p_s must be >= 0"):
        LinkCosts((math.nan,))
    u = StageCosts.uniform(3, 0.5, tw_s=0.25)
    assert u.tb_s == (0.5,) * 3 and u.tw_s == (0.25,) * 3 and u.num_stages == 3
