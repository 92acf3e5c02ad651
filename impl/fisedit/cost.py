"""FISEdit's sparse-step cost over the traced UNet ops (`impl/fisedit/README.md`, "Reconstructed
choices": Sim), shared by sim mode and by the
real mode's theoretical caps.

Which ops go sparse mirrors the engine: convs (3x3, stride-2, 1x1), GroupNorm (fused with
the following conv) and token linears at >= ``conv_min``/``linear_min`` cells; inside a
transformer block at >= ``attn_min`` tokens, everything but attn1's K/V projections, the
LayerNorm that feeds them and attn2's text K/V scales with the active tokens; the rest is
dense. Active fractions come from the actual per-layer masks (max-pooled latent mask, and for
convs its block expansion), so halos, borders and pooling are counted, not assumed.

Sparse op time [R] = roofline(op at its active fraction) + gather/scatter bytes / HBM BW, as
three kernel launches; a block-sparse conv's window conv, gather and scatter go at the
profile's measured window rates where it has them (``conv_window_flops``,
``window_gather_bytes_per_s``, ``window_scatter_bytes_per_s``: tiny tiles and short-row
indexing run far below the dense conv rate and a streaming copy on a CPU), else at the conv
rate and HBM BW, so datasheet profiles price exactly as before. Likewise a 1x1 conv's cell
gather/scatter and a token op's row gather/scatter go at ``cell_*`` / ``token_*_bytes_per_s``
where the profile has them. On a profile with ``host_dispatch_s`` (CPU) each step is also
charged its torch calls serially: the dense forward's (``forward_torch_calls``) and, on the
sparse step, the engine's extra calls per sparse op (``REFERENCE_EXTRA_CALLS``, counted on the
engine's code path by ``tests/fisedit/test_window_pricing.py``; the fused engine: its gather
and scatter, 2). Three kernel launches (gather, op, scatter) instead of one; the step's kernels go through
``stream_time_s`` (host issue overlapped with GPU execution, as on one CUDA stream without
per-op synchronisation), so launch overhead costs time only where kernels are shorter than
their launches. The step's cache bytes cross PCIe overlapped with compute, only the excess is
exposed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from impl.common.diffusion.cost import BYTES, ELEMENTWISE_PASSES, UNetOp, glue_time_s, op_time_s, stream_time_s
from impl.common.diffusion.windows import window_size
from impl.common.hardware import HardwareProfile

from impl.fisedit.mask import layer_mask
from impl.fisedit.sparse import block_mask

DENSE_ROLES_IN_SPARSE_BLOCK = ("attn1.kv", "attn2.kv")

# Torch calls the reference engine (impl/fisedit/sparse_modules.py + sparse.py) issues for one sparse op
# beyond the dense op's one call, per op class, at steady state (masks and block masks memoised):
# a block-sparse conv 17 (clone, nonzero, pad, 2 unfolds, index, permute/reshape, conv, the
# scatter's reshape/permute/view/index_put ...), a 1x1 conv 12, a token linear 4, a GroupNorm's
# cached scale/shift 3 (two broadcasts and addcmul), a sparse transformer block 4 more than its
# dense calls (clone, two token gathers, one scatter). The test counts them on the engine.
REFERENCE_SPARSE_CALLS = {"window_conv": 17, "pointwise_conv": 12, "token_linear": 4, "groupnorm": 3}
REFERENCE_BLOCK_EXTRA_CALLS = 4
FUSED_EXTRA_CALLS = 2  # the fused engine's gather and scatter kernels


@dataclass
class Thresholds:
    conv_min: int
    linear_min: int
    attn_min: int

    @classmethod
    def auto(cls, latent_hw) -> "Thresholds":
        base = latent_hw[0] * latent_hw[1]
        return cls(max(1, base // 16), max(1, base // 16), max(1, base // 4))


def _grid(cells: int, latent_hw) -> tuple:
    H0, W0 = latent_hw
    f = round(math.sqrt(H0 * W0 / cells))
    return (H0 // f, W0 // f)


class MaskFractions:
    """Active-cell and block-expanded fractions of one latent mask, per layer grid."""

    def __init__(self, mask: torch.Tensor, block: int):
        self.mask, self.block, self._c = mask.bool(), block, {}

    def cells(self, hw) -> float:
        key = ("c", hw)
        if key not in self._c:
            self._c[key] = float(layer_mask(self.mask, hw).float().mean())
        return self._c[key]

    def blocks(self, hw, bo) -> tuple:
        """(fraction of output cells recomputed, number of active blocks)."""
        key = ("b", hw, bo)
        if key not in self._c:
            bm = block_mask(layer_mask(self.mask, hw), bo)
            nb = int(bm.sum())
            self._c[key] = (min(1.0, nb * bo * bo / (hw[0] * hw[1])), nb)
        return self._c[key]


def is_windowed(op: UNetOp, th: Thresholds) -> bool:
    """A block-sparse conv on a sparse step: gathered windows (k > 1 or strided)."""
    return op.kind == "conv" and op.cells >= th.conv_min and not (op.kernel == 1 and op.stride == 1)


def window_elems(op: UNetOp, mf: MaskFractions) -> tuple:
    """(compute fraction, window elements gathered, block elements scattered) of a block-sparse conv."""
    bo = max(1, mf.block // op.stride)
    f, nb = mf.blocks(op.hw, bo)
    win = window_size(bo, op.stride, op.kernel)
    batch = op.bytes_out / (op.cout * op.hw[0] * op.hw[1])
    return f, batch * nb * op.cin * win * win, batch * nb * op.cout * bo * bo


def _reference_copies_s(op: UNetOp, th: Thresholds, block_outputs: set, hw: HardwareProfile, b: int) -> float:
    """The reference engine's full-tensor copies around a sparse op: every cached op clones its
    full cached output to scatter onto (read + write; a transformer block once, at its output),
    and a block-sparse conv's ``F.pad`` zero-fills the padded map and copies the input in."""
    elems = 0.0
    if is_cached(op, th) or op.name in block_outputs:
        elems += 2.0 * op.bytes_out
    if is_windowed(op, th):
        elems += 3.0 * op.bytes_in
    return elems * b / hw.memory_bw_bytes_per_s


def gather_scatter_s(op: UNetOp, f: float, gs: float, hw: HardwareProfile, dtype: str) -> float:
    """Seconds of a non-windowed sparse op's gather (``f`` of its input) and scatter (``f`` of
    its output), ``gs`` = their elements: a 1x1 conv's at the cell rates, a token op's at the
    token rates (each the memory bandwidth where the profile has none)."""
    if not gs:
        return 0.0
    b = BYTES[dtype]
    if op.kind == "conv":
        g_bw, s_bw = hw.cell_gather_bw(dtype), hw.cell_scatter_bw(dtype)
    else:
        g_bw, s_bw = hw.token_gather_bw(dtype), hw.token_scatter_bw(dtype)
    if g_bw == s_bw:  # one rate (the memory bandwidth on datasheet profiles): as priced before
        return gs * b / g_bw
    return f * b * (op.bytes_in / g_bw + op.bytes_out / s_bw)


def extra_calls(op: UNetOp, f: float, gs: float, th: Thresholds, engine: str) -> int:
    """Torch calls a sparse step issues for ``op`` beyond the dense forward's (see REFERENCE_SPARSE_CALLS)."""
    if engine != "reference":
        return FUSED_EXTRA_CALLS if (f < 1.0 or gs) else 0
    if op.kind == "groupnorm":
        return REFERENCE_SPARSE_CALLS["groupnorm"] - 1 if f < 1.0 else 0
    if op.kind == "conv" and op.cells >= th.conv_min:
        return REFERENCE_SPARSE_CALLS["window_conv" if is_windowed(op, th) else "pointwise_conv"] - 1
    if op.role == "proj" and gs:
        return REFERENCE_SPARSE_CALLS["token_linear"] - 1
    if op.role == "attn1.q" and gs:  # one per sparse transformer block
        return REFERENCE_BLOCK_EXTRA_CALLS
    return 0


def op_fraction(op: UNetOp, mf: Optional[MaskFractions], th: Thresholds, latent_hw) -> tuple:
    """(compute fraction, gather/scatter elements) of an op on a sparse step; (1, 0) = dense."""
    if mf is None or op.cells == 0:
        return 1.0, 0.0
    if op.kind == "conv":
        if op.cells < th.conv_min:
            return 1.0, 0.0
        hw = op.hw
        if op.kernel == 1 and op.stride == 1:
            f = mf.cells(hw)
            return f, f * (op.bytes_in + op.bytes_out)
        f, gather, scatter = window_elems(op, mf)
        return f, gather + scatter
    if op.kind == "groupnorm":
        if op.cells < th.conv_min or not op.hw:
            return 1.0, 0.0
        return mf.cells(op.hw), 0.0
    hw = _grid(op.cells, latent_hw)
    if op.block:  # inside a transformer block
        if op.cells < th.attn_min:
            return 1.0, 0.0
        if op.role in DENSE_ROLES_IN_SPARSE_BLOCK or op.name.endswith(".norm1"):
            return 1.0, 0.0
        f = mf.cells(hw)
        return f, (f * (op.bytes_in + op.bytes_out) if op.role == "attn1.q" else 0.0)
    if op.role == "proj" and op.cells >= th.linear_min:
        f = mf.cells(hw)
        return f, f * (op.bytes_in + op.bytes_out)
    return 1.0, 0.0


def is_cached(op: UNetOp, th: Thresholds) -> bool:
    """Ops whose outputs the cache holds (those the authors' Hetu executor caches)."""
    if op.cells == 0:
        return False
    if op.kind == "conv":
        return op.cells >= th.conv_min
    if op.role == "proj":
        return op.cells >= th.linear_min
    return False


def cache_bytes_per_step(ops, th: Thresholds, cache_dtype: str = "fp32", latent_elems: int = 0) -> float:
    """Conv/linear outputs at sparse resolutions + one attention-block output per block + GN
    scale/shift + the latent."""
    b = BYTES[cache_dtype]
    total = sum(o.bytes_out for o in ops if is_cached(o, th))
    blocks = {}
    for o in ops:
        if o.block and o.cells >= th.attn_min and o.role == "ff" and o.cout:
            blocks[o.block] = o.bytes_out  # FF output = block output size
    total += sum(blocks.values())
    # GroupNorm scale and shift: 2 x batch x C; bytes_in counts x (1 + ELEMENTWISE_PASSES) times
    total += sum(2 * o.bytes_in / (1 + ELEMENTWISE_PASSES) / o.cells for o in ops
                 if o.kind == "groupnorm" and o.cells >= th.conv_min)
    return (total + latent_elems) * b


@dataclass
class StepCost:
    dense_flops: float
    sparse_flops: float
    dense_s: float = 0.0
    sparse_compute_s: float = 0.0
    h2d_s: float = 0.0
    sparse_s: float = 0.0  # compute + exposed H2D

    @property
    def flops_cap(self) -> float:
        return self.dense_flops / self.sparse_flops if self.sparse_flops else math.inf


SIM_ENGINES = ("fused", "reference")


def step_cost(ops, mask: Optional[torch.Tensor], th: Thresholds, latent_hw, block: int = 2,
              hw: Optional[HardwareProfile] = None, dtype: str = "fp16", launch_s: float = 5e-6,
              cache_bytes: float = 0.0, pcie_efficiency: float = 0.7, cache_on_gpu: bool = False,
              engine: str = "fused", torch_calls: int = 0, glue=()) -> StepCost:
    """``engine``: ``fused`` = the paper's engine (GroupNorm and the activation/residual passes
    charged to it fused into the sparse conv, at the active fraction); ``reference`` = this
    repo's engine (``impl/fisedit/sparse_modules.py``), which applies the cached GroupNorm scale/shift
    and the activations over the full map, clones each sparse op's full cached output and pads
    each block-sparse conv's full input (all timed; FLOP fractions and caps are the same).
    ``torch_calls``: the dense forward's torch calls, charged with the sparse step's extra ones
    at ``hw.host_dispatch_s`` (0 on datasheet profiles: nothing charged). ``glue``: the
    forward's non-module ops (``trace_unet_glue``), priced where the profile has glue rates:
    dense in full; on the sparse step those inside a sparse transformer block at the block's
    active-token fraction (the engine runs the block on gathered tokens), the rest in full (both
    engines: the reference engine applies activations and residuals over the full map; the
    fused engine's fusion of them into the sparse conv is not modelled here)."""
    if engine not in SIM_ENGINES:
        raise ValueError(f"sim engine: unknown value {engine!r} (one of: {', '.join(SIM_ENGINES)})")
    mf = MaskFractions(mask, block) if mask is not None else None
    dense_f = sum(o.flops for o in ops)
    sparse_f = 0.0
    dense_k, sparse_k = [], []  # (gpu seconds, launches) per op, in execution order
    sparse_calls = torch_calls
    # the op that writes each sparse transformer block's output (its last FF linear)
    block_outputs = {o.block: o.name for o in ops if o.block and o.role == "ff" and o.cells >= th.attn_min}
    block_outputs = set(block_outputs.values()) if engine == "reference" else set()
    block_frac: dict = {}  # sparse transformer block -> its active-token fraction (its FF's)
    for o in ops:
        f, gs = op_fraction(o, mf, th, latent_hw)
        if o.block and o.role == "ff":
            block_frac[o.block] = f
        sparse_f += o.flops * f
        if mf is not None:
            sparse_calls += extra_calls(o, f, gs, th, engine)
        if hw is not None:
            t = op_time_s(o, hw, dtype, launch_s=0.0)
            dense_k.append((t, 1))
            b = BYTES[dtype]
            if f >= 1.0 and gs == 0.0 or engine == "reference" and o.kind == "groupnorm":
                sparse_k.append((t, 1))
                continue
            copies = _reference_copies_s(o, th, block_outputs, hw, b) if engine == "reference" else 0.0
            if mf is not None and is_windowed(o, th):
                # the gathered-window conv, its gather and its scatter at their own measured rates
                # (the profile's conv rate and memory bandwidth where it has none)
                _, g_el, s_el = window_elems(o, mf)
                sparse_k.append((op_time_s(o, hw, dtype, flops_scale=f, bytes_scale=f, launch_s=0.0, windowed=True)
                                 + g_el * b / hw.window_gather_bw(dtype) + s_el * b / hw.window_scatter_bw(dtype)
                                 + copies, 3))
            else:  # gather + op on the active part + scatter: three launches
                sparse_k.append((op_time_s(o, hw, dtype, flops_scale=f, bytes_scale=f, launch_s=0.0)
                                 + gather_scatter_s(o, f, gs, hw, dtype) + copies, 3))
    if hw is not None:
        for g in glue:
            if hw.glue_bw(g.kind, dtype):
                dense_k.append((glue_time_s(g, hw, dtype), 1))
                sparse_k.append((glue_time_s(g, hw, dtype, block_frac.get(g.block, 1.0) if mf is not None else 1.0), 1))
    dense_s = stream_time_s(dense_k, launch_s) + torch_calls * hw.diffusion.host_dispatch_s if hw is not None else 0.0
    sparse_s = stream_time_s(sparse_k, launch_s) + sparse_calls * hw.diffusion.host_dispatch_s if hw is not None else 0.0
    cost = StepCost(dense_f, sparse_f, dense_s, sparse_s)
    if hw is not None:
        h2d = 0.0 if cache_on_gpu or mask is None else cache_bytes / (hw.host_link_bw_bytes_per_s * pcie_efficiency)
        cost.h2d_s = h2d
        cost.sparse_s = sparse_s + max(0.0, h2d - sparse_s)
    return cost
