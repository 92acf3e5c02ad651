"""The sparse step prices a block-sparse conv's windows at the profile's measured window rates
(``conv_window_flops``, ``window_gather/scatter_bytes_per_s``), only those convs, and a profile
without them prices exactly as before."""

import pytest
import torch

from impl.common.diffusion.cost import BYTES, op_time_s, trace_unet_ops
from impl.common.diffusion.pipelines import UNetShape
from impl.common.diffusion.windows import gather_windows, pad_for_windows, scatter_blocks
from impl.common.hardware import DiffusionRates, HardwareProfile
from impl.fisedit.cost import MaskFractions, Thresholds, is_windowed, step_cost, window_elems
from impl.fisedit.mask import synthetic_mask

SHAPE = UNetShape(sample_size=16)
HW = (16, 16)
BASE = HardwareProfile(name="t", peak_flops={"fp32": 100e9}, diffusion=DiffusionRates(conv_flops={"fp32": 200e9}),
                       memory_bw_bytes_per_s=40e9, mfu=1.0)


def _cost(hw, f=0.2, dense_mask=False):
    ops = trace_unet_ops(SHAPE, batch=2)
    mask = None if dense_mask else synthetic_mask(HW, f, "rect", seed=0)
    return ops, mask, step_cost(ops, mask, Thresholds.auto(HW), HW, 2, hw, "fp32", 0.0, cache_on_gpu=True)  # no launches: plain sums


def test_absent_window_fields_price_as_the_conv_rate_and_memory_bandwidth():
    # the same numbers written out as the fields = the fallback they replace: identical step
    same = BASE.with_diffusion(conv_window_flops={"fp32": 200e9}, window_gather_bytes_per_s={"fp32": 40e9},
                               window_scatter_bytes_per_s={"fp32": 40e9})
    a, b = _cost(BASE)[2], _cost(same)[2]
    assert a.sparse_compute_s == b.sparse_compute_s and a.dense_s == b.dense_s
    assert BASE.conv_window_flops_per_s("fp32") == BASE.conv_flops_per_s("fp32") == 200e9
    assert BASE.window_gather_bw("fp32") == BASE.window_scatter_bw("fp32") == 40e9


def test_window_rates_price_the_sparse_convs_only():
    slow = BASE.with_diffusion(conv_window_flops={"fp32": 50e9}, window_gather_bytes_per_s={"fp32": 1e9},
                               window_scatter_bytes_per_s={"fp32": 0.5e9})
    ops, mask, base = _cost(BASE)
    _, _, win = _cost(slow)
    assert win.dense_s == base.dense_s  # dense convs keep conv_flops
    assert _cost(slow, dense_mask=True)[2].sparse_compute_s == _cost(BASE, dense_mask=True)[2].sparse_compute_s
    # the step grows by exactly the windowed convs' difference
    th, mf, b = Thresholds.auto(HW), MaskFractions(mask, 2), BYTES["fp32"]
    extra = 0.0
    for o in ops:
        if not is_windowed(o, th):
            continue
        f, g, s = window_elems(o, mf)
        old = op_time_s(o, BASE, "fp32", flops_scale=f, bytes_scale=f, launch_s=0) + (g + s) * b / 40e9
        new = op_time_s(o, slow, "fp32", flops_scale=f, bytes_scale=f, launch_s=0, windowed=True) + g * b / 1e9 + s * b / 0.5e9
        extra += new - old
    assert extra > 0
    assert win.sparse_compute_s - base.sparse_compute_s == pytest.approx(extra, rel=1e-6)
    # a 1x1 conv is not windowed: its op time ignores the window rate
    k1 = next(o for o in ops if o.kind == "conv" and o.kernel == 1)
    assert not is_windowed(k1, th)
    assert op_time_s(k1, slow, "fp32", launch_s=0) == op_time_s(k1, BASE, "fp32", launch_s=0)


def test_gather_and_scatter_match_plain_slicing():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6)
    idx = torch.tensor([[0, 1], [2, 2]])
    xp = pad_for_windows(x, (1, 1), (3, 3), 2, 4)
    w = gather_windows(xp, idx, 4, 2)
    assert w.shape == (4, 3, 4, 4)
    assert torch.equal(w[1], xp[0, :, 4:8, 4:8]) and torch.equal(w[2], xp[1, :, 0:4, 2:6])
    out = torch.zeros(2, 3, 6, 6)
    y = torch.randn(4, 3, 2, 2)
    scatter_blocks(out, idx, y, 2)
    assert torch.equal(out[0, :, 0:2, 2:4], y[0]) and torch.equal(out[1, :, 4:6, 4:6], y[3])
    assert int((out != 0).sum()) == y.numel()


def test_reference_engine_prices_full_map_norms_and_copies_on_sparse_steps_only():
    ops = trace_unet_ops(SHAPE, batch=2)
    mask = synthetic_mask(HW, 0.2, "rect", seed=0)
    th = Thresholds.auto(HW)

    def cost(engine, m=mask):
        return step_cost(ops, m, th, HW, 2, BASE, "fp32", 0.0, cache_on_gpu=True, engine=engine)

    fused, ref = cost("fused"), cost("reference")
    assert ref.dense_s == fused.dense_s and ref.sparse_flops == fused.sparse_flops  # caps unchanged
    assert ref.sparse_compute_s > fused.sparse_compute_s
    assert cost("reference", None).sparse_compute_s == cost("fused", None).sparse_compute_s  # no mask: dense
    with pytest.raises(ValueError, match="sim engine: unknown value 'gpu'"):
        cost("gpu")


def test_sim_engine_knob_is_checked_and_the_fidelity_profile_selects_reference():
    from types import SimpleNamespace

    from bench.fidelity.families import _diffusion
    from impl.common.api import ConfigError, RunResult
    from impl.fisedit.system import FISEditSystem

    with pytest.raises(ConfigError, match="system.sim_engine: unknown value 'gpu' \\(one of: fused, reference\\)"):
        FISEditSystem(FISEditSystem.Config(sim_engine="gpu"), "fisedit")
    wl = SimpleNamespace(mask_ratio=0.1, dtype="fp32", num_steps=20)
    assert _diffusion(RunResult(metrics={}, info={}), wl).system == {"sim_engine": "reference"}
