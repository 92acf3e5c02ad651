"""Diffusion substrate: components through save/load, tokenizer, stock pipelines, metrics, cost."""
import math

import numpy as np
import pytest
import torch
from skimage.metrics import peak_signal_noise_ratio

from impl.common.diffusion.cost import trace_unet_ops
from impl.common.diffusion.pipelines import (UNetShape, build_components, build_tokenizer, build_unet,
                                             encode_prompts, sd_pipeline)
from impl.common.diffusion.quality import psnr, ssim

SMALL = UNetShape(sample_size=8, block_out_channels=[16, 32], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                  up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], cross_attention_dim=16, attention_head_dim=4,
                  norm_num_groups=8)


def test_components_roundtrip_through_save_pretrained(tmp_path):
    torch.set_num_threads(1)
    c = build_components(SMALL, seed=3, save_dir=tmp_path)
    fresh = build_unet(SMALL, 3)
    for (k, a), (_, b) in zip(c.unet.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), k
    assert (tmp_path / "unet" / "config.json").exists() and (tmp_path / "tokenizer").exists()
    e = encode_prompts(c, ["", "a cat"])
    assert e.shape == (2, 77, 16)
    out = sd_pipeline(c, "text2img")("a cat", num_inference_steps=2, height=64, width=64, output_type="latent",
                                     generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (1, 4, 8, 8) and torch.isfinite(out.images).all()


def test_tokenizer_built_in_memory():
    tok = build_tokenizer()
    ids = tok("a cat").input_ids
    assert ids[0] == 0 and ids[-1] == 1 and len(ids) == 6


def test_psnr_ssim_against_scikit_image():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(4, 8, 8)).astype(np.float32)
    b = a + 0.01 * rng.normal(size=a.shape).astype(np.float32)
    rngv = float(a.max() - a.min())
    assert math.isclose(psnr(a, b), peak_signal_noise_ratio(a, b, data_range=rngv), rel_tol=1e-9)
    mask = np.zeros((8, 8), dtype=bool)
    mask[:4] = True
    sel = np.broadcast_to(mask, a.shape)
    assert math.isclose(psnr(a, b, mask), peak_signal_noise_ratio(a[sel], b[sel], data_range=rngv), rel_tol=1e-9)
    assert psnr(a, a) == math.inf
    assert ssim(a, a) > 0.999 and ssim(a, b, mask) < 1.0


def test_cost_model_conv_flops():
    ops = trace_unet_ops(SMALL, batch=2)
    conv_in = next(o for o in ops if o.name == "conv_in")
    assert conv_in.flops == 2.0 * 2 * 4 * 16 * 9 * 8 * 8
    kinds = {o.kind for o in ops}
    assert {"conv", "linear", "attn_core", "groupnorm", "layernorm"} <= kinds
    attn2 = [o for o in ops if o.role == "attn2.core"]
    assert attn2 and all(o.flops == 4.0 * 2 * 64 * 77 * 16 for o in attn2 if o.cells == 64)


def test_attention_rate_prices_the_attention_core_only():
    from impl.common.diffusion.cost import UNetOp, op_time_s
    from impl.common.hardware import DiffusionRates, HardwareProfile

    core = UNetOp("a.core", "attn_core", 64, 2e9, 0, 0, 0)
    lin = UNetOp("a.to_q", "linear", 64, 2e9, 0, 0, 0)
    base = HardwareProfile(name="t", peak_flops={"fp32": 100e9}, memory_bw_bytes_per_s=1e12, mfu=1.0)
    hw = HardwareProfile(name="t", peak_flops={"fp32": 100e9}, diffusion=DiffusionRates(attn_flops={"fp32": 50e9}),
                         memory_bw_bytes_per_s=1e12,
                         mfu=1.0)
    assert op_time_s(core, hw, "fp32", launch_s=0) == pytest.approx(0.04)
    assert op_time_s(lin, hw, "fp32", launch_s=0) == op_time_s(lin, base, "fp32", launch_s=0) == pytest.approx(0.02)
    assert op_time_s(core, base, "fp32", launch_s=0) == pytest.approx(0.02)  # absent: the matmul rate
