"""The sparse step prices a 1x1 conv's cell gather/scatter and a token op's row gather/scatter
at the profile's measured rates and charges host dispatch per torch call on a CPU profile;
each only for the ops it is for, and a profile without them prices exactly as before. The call
counts the sim charges are the ones the engine issues (counted on the engine itself)."""

import pytest
import torch

from impl.common.diffusion.cost import TorchCallCounter, forward_torch_calls, trace_unet_ops
from impl.common.diffusion.pipelines import UNetShape
from impl.common.diffusion.windows import gather_cells, gather_tokens, scatter_cells, scatter_tokens
from impl.common.hardware import DiffusionRates, HardwareProfile
from impl.fisedit import cost as costmodel
from impl.fisedit.cost import (REFERENCE_BLOCK_EXTRA_CALLS, REFERENCE_SPARSE_CALLS, MaskFractions, Thresholds,
                                    extra_calls, op_fraction, step_cost)
from impl.fisedit.mask import synthetic_mask

SHAPE = UNetShape(sample_size=16)
HW = (16, 16)
BASE = HardwareProfile(name="t", peak_flops={"fp32": 100e9}, diffusion=DiffusionRates(conv_flops={"fp32": 200e9}),
                       memory_bw_bytes_per_s=40e9, mfu=1.0)
OPS = trace_unet_ops(SHAPE, batch=2)
TH = Thresholds.auto(HW)
MASK = synthetic_mask(HW, 0.2, "rect", seed=0)


def _cost(hw, mask=MASK, engine="reference", calls=0):
    return step_cost(OPS, mask, TH, HW, 2, hw, "fp32", 0.0, cache_on_gpu=True, engine=engine, torch_calls=calls)


def _gs_ops(pred):
    mf = MaskFractions(MASK, 2)
    rows = []
    for o in OPS:
        f, gs = op_fraction(o, mf, TH, HW)
        if gs and not costmodel.is_windowed(o, TH) and pred(o):
            rows.append((o, f))
    return rows


def test_absent_fields_price_as_before():
    same = BASE.with_diffusion(**{k: {"fp32": 40e9} for k in (
        "cell_gather_bytes_per_s", "cell_scatter_bytes_per_s", "token_gather_bytes_per_s", "token_scatter_bytes_per_s")})
    for engine in ("fused", "reference"):
        a, b = _cost(BASE, engine=engine), _cost(same, engine=engine)
        assert a.sparse_compute_s == b.sparse_compute_s and a.dense_s == b.dense_s
        # no host_dispatch_s (datasheet profiles): the call count changes nothing
        c = _cost(BASE, engine=engine, calls=5000)
        assert c.sparse_compute_s == a.sparse_compute_s and c.dense_s == a.dense_s
    assert BASE.cell_gather_bw("fp32") == BASE.token_scatter_bw("fp32") == 40e9 and BASE.diffusion.host_dispatch_s == 0.0


@pytest.mark.parametrize("kind", ["cell", "token"])
def test_each_gather_rate_moves_only_its_ops(kind):
    slow = BASE.with_diffusion(**{f"{kind}_gather_bytes_per_s": {"fp32": 2e9},
                                        f"{kind}_scatter_bytes_per_s": {"fp32": 1e9}})
    base, new = _cost(BASE), _cost(slow)
    assert new.dense_s == base.dense_s
    assert _cost(slow, mask=None).sparse_compute_s == _cost(BASE, mask=None).sparse_compute_s
    ops = _gs_ops((lambda o: o.kind == "conv") if kind == "cell" else (lambda o: o.kind != "conv"))
    assert ops, f"the tiny UNet has {kind} gathers"
    extra = sum(f * 4 * (o.bytes_in / 2e9 + o.bytes_out / 1e9) - f * (o.bytes_in + o.bytes_out) * 4 / 40e9
                for o, f in ops)
    assert extra > 0
    assert new.sparse_compute_s - base.sparse_compute_s == pytest.approx(extra, rel=1e-9)


def test_host_dispatch_charges_the_dense_calls_and_the_engines_extra_calls():
    d = 1e-6
    cpu = BASE.with_diffusion(host_dispatch_s=d)
    mf = MaskFractions(MASK, 2)
    for engine in ("fused", "reference"):
        base, new = _cost(BASE, engine=engine), _cost(cpu, engine=engine, calls=1000)
        extra = sum(extra_calls(o, *op_fraction(o, mf, TH, HW), TH, engine) for o in OPS)
        assert extra > 0
        assert new.dense_s - base.dense_s == pytest.approx(1000 * d, rel=1e-9)
        assert new.sparse_compute_s - base.sparse_compute_s == pytest.approx((1000 + extra) * d, rel=1e-9)
    # the reference engine issues more calls per sparse op than the fused one's gather + scatter
    ref = sum(extra_calls(o, *op_fraction(o, mf, TH, HW), TH, "reference") for o in OPS)
    fused = sum(extra_calls(o, *op_fraction(o, mf, TH, HW), TH, "fused") for o in OPS)
    assert ref > fused


def _calls(fn, *args):
    with TorchCallCounter() as c:
        fn(*args)
    return c.calls


def test_call_counts_are_the_engines(comps):
    """The sim's per-op counts = the torch calls of the engine's wrappers on a sparse step, at
    steady state (second forward), and its dense forward count = the real forward's."""
    from impl.fisedit.cache import ActivationCache
    from impl.fisedit.sparse_modules import EngineState, install, uninstall, wrappers
    from impl.fisedit.sparse import sparse_token_linear

    unet = comps.unet
    x = torch.randn(2, 4, 16, 16)
    e = torch.randn(2, 77, unet.config.cross_attention_dim)
    t = torch.tensor(10)
    with torch.no_grad(), TorchCallCounter() as dense:
        unet(x, t, encoder_hidden_states=e)
    # the meta-device forward takes the real one's code path; a few .contiguous() calls differ
    # (7 of 566 on this UNet: meta tensors' strides), nothing else
    assert abs(forward_torch_calls(SHAPE, batch=2) - dense.calls) <= 0.02 * dense.calls
    st = EngineState(latent_hw=HW, engine="reference")  # the engine sim_engine=reference prices
    install(unet, st)
    try:
        cache = ActivationCache()
        st.record_cache, st.mode, st.step = cache, "record", 0
        cache.begin_step(0)
        with torch.no_grad():
            unet(x, t, encoder_hidden_states=e)
        cache.end_step(0)
        st.record_cache, st.mode, st.cache = None, "edit", cache
        st.set_mask(MASK)
        counts: dict = {}
        for name, w in wrappers(unet).items():
            def counted(*a, _f=w._forward, _n=name):
                with TorchCallCounter() as c:
                    out = _f(*a)
                counts[_n] = c.calls
                return out
            w._forward = counted
        per_mode = {}
        for sparse in (True, True, False):  # the second sparse forward: memoised masks (steady state)
            st.sparse = sparse
            with torch.no_grad():
                unet(x, t, encoder_hidden_states=e)
            per_mode[sparse] = dict(counts)
    finally:
        uninstall(unet)
    by_name = {o.name: o for o in OPS}
    seen = set()
    for name, n in per_mode[True].items():
        if name.endswith("transformer_blocks.0") or ".transformer_blocks." in name:
            cls = "block"
            if n != per_mode[False][name]:
                assert n - per_mode[False][name] == REFERENCE_BLOCK_EXTRA_CALLS, name
                seen.add(cls)
            continue
        if n == 1:
            continue  # ran dense (below its threshold)
        o = by_name[name]
        cls = ("groupnorm" if o.kind == "groupnorm" else
               "window_conv" if costmodel.is_windowed(o, TH) else "pointwise_conv")
        assert n == REFERENCE_SPARSE_CALLS[cls], (name, n)
        seen.add(cls)
    assert seen == {"groupnorm", "window_conv", "pointwise_conv", "block"}
    lin = torch.nn.Linear(8, 6)
    assert _calls(sparse_token_linear, torch.randn(2, 10, 8), lin, torch.tensor([1, 3]), torch.zeros(2, 10, 6)) \
        == REFERENCE_SPARSE_CALLS["token_linear"]


def test_cell_and_token_gathers_match_plain_indexing():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4)
    flat = torch.tensor([1, 5, 10])
    assert torch.equal(gather_cells(x, flat), x.reshape(2, 3, 16)[:, :, flat])
    out = torch.zeros(2, 3, 4, 4)
    scatter_cells(out, flat, torch.ones(2, 3, 3))
    assert out.reshape(2, 3, 16)[:, :, flat].eq(1).all() and int(out.sum()) == 18
    seq = torch.randn(2, 16, 3)
    assert torch.equal(gather_tokens(seq, flat), seq[:, flat])
    so = torch.zeros(2, 16, 3)
    scatter_tokens(so, flat, torch.ones(2, 3, 3))
    assert so[:, flat].eq(1).all() and int(so.sum()) == 18
