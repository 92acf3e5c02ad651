"""Closed-form transformer and communication costs."""
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
from impl.common.cost.transformer import layer_fwd_flops, layer_matrix_params
from impl.common.hardware import HardwareProfile
from impl.common.servesim.cost import ServingCost
from impl.common.workloads.pipeline import ModelShape
from impl.common.workloads.serving import LlamaShape, PaperModel
from impl.common.megatron.derive import comm_efficiencies


@pytest.fixture
def h800() -> HardwareProfile:
    # ADAPTRA's sim profile [R] (impl/adaptra/README.md): H800 = H100 (989 TF fp16 dense) with 400 GB/s NVLink; 400 Gb/s IB; PCIe5 50 GB/s.
    # Its step model (kernel tables, knobs) is carried from h100-megatron.
    return HardwareProfile(name="h800-spec", source="ADAPTRA sim profile [R]", peak_flops={"fp16": 989e12, "bf16": 989e12},
                           mfu=0.4, gpus_per_node=8, intra_node_bw_bytes_per_s=400e9, memory_bytes=80e9,
                           memory_bw_bytes_per_s=3.35e12,
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
    # ADAPTRA's sanity figure [R], 14B ~10 ms forward per stage, comes from FLOPs at 40% of peak; the step model (H100 kernel tables carried
    # to this profile, memory-bound kernels, per-layer overhead) lands within 15% of it (11.3 ms).
    assert max(costs.tf_s) == pytest.approx(10e-3, rel=0.15)
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
    m = ModelShape(num_layers=12, hidden=h, vocab=50257, seq_len=1024)
    assert layer_params(m) == 12 * h * h + 13 * h
    assert model_params(m) == 124_439_808  # GPT-2 small, as published (tied LM head)
    assert sum(stage_grad_bytes(m, 4, "fp16")) == 12 * layer_params(m) * 2


# Published parameter counts of Llama 2 (no biases, SwiGLU, untied LM head; 70B uses 8 KV heads).
@pytest.mark.parametrize("shape, published", [
    (PaperModel(name="llama2-7b"), 6_738_415_616),
    (PaperModel(name="llama2-13b", num_layers=40, hidden=5120, heads=40, kv_heads=40, ffn_hidden=13824), 13_015_864_320),
    (PaperModel(name="llama2-70b", num_layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672), 68_976_648_192),
])
def test_llama_param_counts_match_the_published_ones(shape, published):
    assert model_params(shape) == published
    # A SwiGLU layer is not a 4h MLP: the count follows ffn_hidden (3 matrices) and the KV heads.
    h, f, kv = shape.hidden, shape.ffn_hidden, shape.kv_hidden
    assert layer_params(shape) == 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    assert layer_fwd_flops(shape, 1) == 2 * shape.seq_len * layer_matrix_params(shape) + 4 * shape.seq_len ** 2 * h


def _numel(module, matrices_only=False) -> int:
    return sum(p.numel() for p in module.parameters() if not matrices_only or p.dim() == 2)


def test_gpt_layer_params_equal_the_built_tiny_gpt():
    from impl.common.models.tiny_gpt import TinyGPT

    shape = ModelShape(num_layers=2, hidden=32, heads=4, ffn_mult=3, vocab=64, seq_len=16)
    model = TinyGPT(shape, seed=0)
    assert layer_params(shape) == _numel(model.blocks[0])
    assert layer_matrix_params(shape) == _numel(model.blocks[0], matrices_only=True)


def test_swiglu_gqa_params_equal_the_built_tiny_llama():
    from impl.common.llm.model import build_llama

    shape = LlamaShape(num_layers=3, hidden=64, heads=4, kv_heads=2, ffn_hidden=176, vocab=300, seq_len=128)
    model = build_llama(shape)
    layer = model.model.layers[0]
    assert layer_params(shape) == _numel(layer)
    assert layer_matrix_params(shape) == _numel(layer, matrices_only=True)
    assert model_params(shape) == _numel(model)
    # The serving cost counts the same matrices.
    assert ServingCost(model=PaperModel(**{k: getattr(shape, k) for k in ("num_layers", "hidden", "heads", "kv_heads",
                                                                            "ffn_hidden", "vocab")})).layer_params \
        == layer_matrix_params(shape)


def test_swiglu_stage_costs_and_grad_bytes_follow_ffn_hidden(h800):
    gpt = ModelShape(num_layers=8, hidden=1024, heads=8, ffn_mult=4, vocab=32000, seq_len=512)
    # Same width as a 4h GPT MLP, but SwiGLU has 3 matrices: 1.5x the MLP weights and FLOPs.
    llama = ModelShape(num_layers=8, hidden=1024, heads=8, ffn_hidden=4096, vocab=32000, seq_len=512)
    h, f = 1024, 4096
    assert layer_matrix_params(llama) - layer_matrix_params(gpt) == h * f
    g_gpt, g_llama = stage_grad_bytes(gpt, 2, "fp16"), stage_grad_bytes(llama, 2, "fp16")
    assert g_llama[0] == 4 * layer_params(llama) * 2 and g_llama[0] > g_gpt[0]
    c_gpt, c_llama = stage_costs(gpt, 2, 1, "fp16", 1, h800), stage_costs(llama, 2, 1, "fp16", 1, h800)
    assert c_llama.tf_s[0] > c_gpt.tf_s[0]
    assert c_llama.layers == c_gpt.layers == (4, 4)


def test_ring_allreduce_and_tp_costs(h800):
    eff = comm_efficiencies(h800)
    nvlink = h800.intra_node_bw_bytes_per_s * eff["intra_efficiency"]
    assert ring_allreduce_time_s(1e9, 1, h800) == 0.0
    assert ring_allreduce_time_s(1e9, 4, h800) == pytest.approx(2 * 3 / 4 * 1e9 / nvlink + 6 * h800.intra_node_latency_s)
    m = gpt14b()
    base = stage_costs(m, 8, 1, "fp16", 1, h800)
    tp2 = stage_costs(m, 8, 1, "fp16", 2, h800)
    ar = tp_allreduce_time_s(1, m.seq_len, m.hidden, "fp16", 2, h800)
    nbytes = 1024 * 5120 * 2
    assert ar == pytest.approx(2 * 1 / 2 * nbytes / nvlink + 2 * h800.intra_node_latency_s)
    # W shrinks with TP (not to half: narrower GEMMs run below the wide ones' rate) and pays no
    # collective; F and B also pay two all-reduces per layer.
    assert base.tw_s[0] / 2 < tp2.tw_s[0] < base.tw_s[0]
    assert tp2.tf_s[0] == pytest.approx(tp2.tw_s[0] + 6 * 2 * ar)
    assert tp2.tb_s == tp2.tf_s


def test_p2p_placement(h800):
    nbytes = 1024 * 5120 * 2
    # tp=dp=1, 8 GPUs per node: stages 0..7 share node 0, stage 8 is on node 1.
    assert same_node(0, 1, 1, 1, 8) and not same_node(7, 8, 1, 1, 8)
    eff = comm_efficiencies(h800)
    # one NVLink inside a node, ONE NIC across nodes, at the step model's link efficiencies
    assert p2p_time_s(0, 1, nbytes, h800) == pytest.approx(
        h800.intra_node_latency_s + nbytes / (h800.intra_node_bw_bytes_per_s * eff["intra_efficiency"]))
    assert p2p_time_s(7, 8, nbytes, h800) == pytest.approx(
        h800.inter_node_latency_s + nbytes / (h800.inter_node_bw_bytes_per_s * eff["inter_efficiency"]))
    # tp·dp = 8 fills a node per stage: every pipeline link crosses nodes.
    assert not same_node(0, 1, 4, 2, 8)
    # tp·dp = 2: four stages per node.
    assert same_node(2, 3, 2, 1, 8) and not same_node(3, 4, 2, 1, 8)
    links = LinkCosts.from_hardware(16, nbytes, h800)
    assert len(links.p2p_s) == 15 and links.p2p_s[7] > links.p2p_s[6]
    assert links.copy_s == pytest.approx(nbytes / 50e9)


def test_dp_allreduce_gated_by_slow_link(h800):
    # one rank per node: the ring runs over one NIC
    nic = h800.inter_node_bw_bytes_per_s * comm_efficiencies(h800)["inter_efficiency"]
    base = dp_allreduce_time_s(1e9, 4, h800, 1)
    assert base == pytest.approx(2 * 3 / 4 * 1e9 / nic + 6 * h800.inter_node_latency_s)
    assert dp_allreduce_time_s(1e9, 4, h800, 1, slow_link_delay_s=0.03) == pytest.approx(base + 6 * 0.03)
    assert dp_allreduce_time_s(1e9, 1, h800, 1, 0.03) == 0.0


def test_stage_costs_validation():
    with pytest.raises(ConfigError, match="tb_s must be >= 0"):
        StageCosts((1.0,), (-1.0,), (1.0,))
    with pytest.raises(ConfigError, match="lengths 2/1/1"):
        StageCosts((1.0, 1.0), (1.0,), (1.0,))
    with pytest.raises(ConfigError, match="p2p_s must be >= 0"):
        LinkCosts((math.nan,))
    u = StageCosts.uniform(3, 0.5, tw_s=0.25)
    assert u.tb_s == (0.5,) * 3 and u.tw_s == (0.25,) * 3 and u.num_stages == 3
