"""The diffusion roofline's token-linear rate and glue ops (non-module tensor work)."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.overrides import TorchFunctionMode

from impl.common.diffusion.cost import (GLUE_ACTIVATIONS, UNetOp, dense_step_time_s, glue_time_s, op_time_s,
                                        trace_unet_glue, trace_unet_ops)
from impl.common.diffusion.pipelines import UNetShape, build_unet
from impl.common.hardware import HardwareProfile

SMALL = UNetShape(sample_size=8, block_out_channels=[16, 32], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                  up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], cross_attention_dim=16, attention_head_dim=4,
                  norm_num_groups=8)
BASE = dict(name="t", peak_flops={"fp32": 100e9}, memory_bw_bytes_per_s=10e9, mfu=1.0)
GLUE = dict(activation_bytes_per_s={"fp32": 2e9}, elementwise_bytes_per_s={"fp32": 5e9})


def test_linear_rate_prices_linears_only():
    lin = UNetOp("b.ff", "linear", 64, 2e9, 0, 0, 0)
    conv = UNetOp("c", "conv", 64, 2e9, 0, 0, 0, kernel=1)
    base, hw = HardwareProfile(**BASE), HardwareProfile(**BASE).with_diffusion(linear_flops={"fp32": 50e9})
    assert op_time_s(lin, hw, "fp32", launch_s=0) == pytest.approx(0.04)
    assert op_time_s(lin, base, "fp32", launch_s=0) == pytest.approx(0.02)  # absent: the matmul rate
    assert op_time_s(conv, hw, "fp32", launch_s=0) == op_time_s(conv, base, "fp32", launch_s=0)


class _Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n[getattr(func, "__name__", "")] += 1
        return func(*args, **(kwargs or {}))


def test_glue_trace_matches_the_cpu_forward():
    # The meta trace sees the activations a real CPU forward issues, one op per call, sized by
    # the real tensors (SiLU bytes = 2 x its map; every activation is in a resnet or a block).
    torch.manual_seed(0)
    unet = build_unet(SMALL, 0).eval()
    counter = _Count()
    with torch.no_grad(), counter:
        unet(torch.randn(2, 4, 8, 8), torch.tensor(10), encoder_hidden_states=torch.randn(2, 77, 16))
    glue = trace_unet_glue(SMALL, batch=2)
    acts = collections.Counter(o.name.split(":")[1] for o in glue if o.kind == "activation")
    assert acts == {k: counter.n[k] for k in GLUE_ACTIVATIONS if counter.n[k]}
    assert all(o.bytes_out > 0 and o.flops == 0 for o in glue)
    silu = [o for o in glue if o.name.endswith(":silu") and o.cells]
    assert silu and all(o.bytes_in == o.bytes_out for o in silu)
    # the GEGLU gate's activation and product sit in their transformer block
    assert any(o.block and o.name.endswith(":gelu") for o in glue)
    assert any(o.block and o.name.endswith(":mul") for o in glue)


def test_glue_priced_only_on_profiles_with_glue_rates():
    ops, glue = trace_unet_ops(SMALL, batch=2), trace_unet_glue(SMALL, batch=2)
    base, hw = HardwareProfile(**BASE), HardwareProfile(**BASE).with_diffusion(**GLUE)
    # datasheet-like profile: glue changes nothing (the norms' ELEMENTWISE_PASSES stand for it)
    assert dense_step_time_s(ops, base, "fp32", glue=glue) == dense_step_time_s(ops, base, "fp32")
    assert all(glue_time_s(g, base, "fp32") == 0.0 for g in glue)
    # with rates: every glue op at its kind's rate, the norms without their extra passes
    norms = [o for o in ops if o.kind in ("groupnorm", "layernorm")]
    expect = sum((g.bytes_in + g.bytes_out) * 4 / (2e9 if g.kind == "activation" else 5e9) for g in glue)
    assert sum(glue_time_s(g, hw, "fp32") for g in glue) == pytest.approx(expect)
    assert sum(op_time_s(o, hw, "fp32", launch_s=0) for o in norms) == pytest.approx(
        sum(op_time_s(o, base, "fp32", launch_s=0) for o in norms) / 3)
    with_glue = dense_step_time_s(ops, hw, "fp32", launch_s=0.0, glue=glue)
    no_glue = dense_step_time_s(ops, hw, "fp32", launch_s=0.0)
    assert with_glue == pytest.approx(no_glue + expect)


def test_sparse_step_glue_scales_inside_sparse_blocks_only():
    from impl.fisedit.cost import Thresholds, step_cost

    shape = UNetShape(sample_size=32, block_out_channels=[32, 64], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                      up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], cross_attention_dim=16,
                      attention_head_dim=4, norm_num_groups=8)
    ops, glue = trace_unet_ops(shape, batch=2), trace_unet_glue(shape, batch=2)
    hw = HardwareProfile(**BASE).with_diffusion(**GLUE)
    lhw = (32, 32)
    th = Thresholds(conv_min=64, linear_min=64, attn_min=64)
    mask = torch.zeros(lhw, dtype=torch.bool)
    mask[:8, :8] = True
    kw = dict(hw=hw, dtype="fp32", launch_s=0.0, cache_on_gpu=True, engine="reference")
    with_g = step_cost(ops, mask, th, lhw, 2, glue=glue, **kw)
    without = step_cost(ops, mask, th, lhw, 2, **kw)
    dense_glue = with_g.dense_s - without.dense_s
    sparse_glue = with_g.sparse_compute_s - without.sparse_compute_s
    outside = sum(glue_time_s(g, hw, "fp32") for g in glue if not g.block)
    assert dense_glue == pytest.approx(sum(glue_time_s(g, hw, "fp32") for g in glue))
    # resnet glue runs over the full map on the sparse step; block glue at its token fraction
    assert outside < sparse_glue < dense_glue
