"""The sparse engine: wrapper modules swapped into a real diffusers UNet (spec 2.4-2.5).

:func:`install` replaces, in place, every ``nn.Conv2d`` with :class:`CachedConv2d`, every
``nn.GroupNorm`` with :class:`CachedGroupNorm`, the token-wise ``proj_in``/``proj_out`` Linear
layers of ``Transformer2DModel`` with :class:`CachedTokenLinear` and every
``BasicTransformerBlock`` with :class:`CachedTransformerBlock` (the paper's default fused
attn1+attn2+FF block: its output is cached, no blending). :func:`uninstall` puts the
originals back. All wrappers share one :class:`EngineState`:

- ``off``: pass-through (dense);
- ``record``: run dense and store the output (GroupNorm: per-sample per-channel scale/shift)
  into ``state.record_cache`` at ``state.step``;
- ``edit``: on a sparse step, ops at or above their resolution threshold recompute only the
  active cells of their layer mask and take the cached output at ``state.step`` elsewhere;
  on a dense step they run dense. An edit may also record (continuous editing).
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from impl.common.diffusion.windows import gather_tokens, scatter_tokens

from .cache import ActivationCache
from .mask import layer_mask
from .sparse import block_mask, conv_geometry, expand_blocks, sparse_conv2d, sparse_token_linear


@dataclass
class EngineState:
    latent_hw: tuple
    mode: str = "off"  # off | record | edit
    step: int = 0
    sparse: bool = False  # this step runs sparse (edit mode)
    cache: Optional[ActivationCache] = None  # read in edit mode
    record_cache: Optional[ActivationCache] = None  # written in record mode (and optionally edit)
    mask: Optional[torch.Tensor] = None  # latent mask (H0, W0) bool
    block: int = 2
    exact: bool = False  # recompute GroupNorm statistics instead of the cached scale/shift
    radical_attn: bool = False
    conv_min_cells: int = 0  # 0 = (H0/4)^2, mirroring 24^2 of a 96^2 latent
    linear_min_cells: int = 0
    attn_min_cells: int = 0  # 0 = (H0/2)^2, mirroring 48^2
    timing: bool = False
    op_times: dict = field(default_factory=lambda: defaultdict(float))
    op_kinds: dict = field(default_factory=dict)
    op_shapes: dict = field(default_factory=dict)
    counts: dict = field(default_factory=lambda: defaultdict(int))
    _memo: dict = field(default_factory=dict)

    def __post_init__(self):
        H0, W0 = self.latent_hw
        base = H0 * W0
        self.conv_min_cells = self.conv_min_cells or max(1, base // 16)
        self.linear_min_cells = self.linear_min_cells or max(1, base // 16)
        self.attn_min_cells = self.attn_min_cells or max(1, base // 4)

    def set_mask(self, mask: Optional[torch.Tensor]) -> None:
        self.mask = None if mask is None else mask.bool().cpu()
        self._memo.clear()

    def set_block(self, block: int) -> None:
        self.block = int(block)
        self._memo.clear()

    # per-layer masks, memoised per (h, w) and device
    def cells(self, hw, device) -> torch.Tensor:
        key = ("cells", tuple(hw), str(device))
        if key not in self._memo:
            self._memo[key] = layer_mask(self.mask, tuple(hw)).to(device)
        return self._memo[key]

    def blocks(self, hw, bo, device) -> torch.Tensor:
        key = ("blocks", tuple(hw), bo, str(device))
        if key not in self._memo:
            self._memo[key] = block_mask(self.cells(hw, "cpu"), bo).to(device)
        return self._memo[key]

    def token_idx(self, hw, device) -> torch.Tensor:
        key = ("tokens", tuple(hw), str(device))
        if key not in self._memo:
            self._memo[key] = self.cells(hw, "cpu").flatten().nonzero().squeeze(1).to(device)
        return self._memo[key]

    def tokens_hw(self, n: int) -> tuple:
        H0, W0 = self.latent_hw
        s = math.sqrt(H0 * W0 / n)
        f = round(s)
        if f < 1 or f * f * n != H0 * W0 or H0 % f or W0 % f:
            raise ValueError(f"{n} tokens do not form a pooled grid of the {H0}x{W0} latent")
        return (H0 // f, W0 // f)

    def rec(self, name: str, t: torch.Tensor) -> None:
        if self.record_cache is not None and self.mode in ("record", "edit"):
            self.record_cache.put(self.step, name, t)


class _Wrapper(nn.Module):
    kind = "op"

    def __init__(self, name: str, inner: nn.Module, state: EngineState):
        super().__init__()
        self.inner = inner
        self.op_name = name
        self.state = state  # plain attribute: not a module

    def _timed(self, fn, *args):
        st = self.state
        if not st.timing:
            return fn(*args)
        t0 = time.perf_counter()
        out = fn(*args)
        st.op_times[self.op_name] += time.perf_counter() - t0
        st.op_kinds[self.op_name] = self.kind
        return out


class CachedConv2d(_Wrapper):
    kind = "conv"

    def forward(self, x):
        return self._timed(self._forward, x)

    def _forward(self, x):
        st, conv = self.state, self.inner
        if st.mode == "off":
            return conv(x)
        H, W = x.shape[-2:]
        k, s, p = conv.kernel_size[0], conv.stride[0], conv.padding
        Ho = (H + 2 * p[0] - k) // s + 1
        Wo = (W + 2 * p[1] - k) // s + 1
        st.op_shapes[self.op_name] = (tuple(x.shape), (Ho, Wo))
        if st.mode == "edit" and st.sparse and Ho * Wo >= st.conv_min_cells:
            cached = st.cache.get(st.step, self.op_name, x.device)
            g = conv_geometry(conv, st.block)
            blocks = None if (k == 1 and s == 1) else st.blocks((Ho, Wo), g["bo"], x.device)
            y = sparse_conv2d(x, conv, st.cells((Ho, Wo), x.device), cached, st.block, blocks=blocks)
            st.counts["sparse_conv"] += 1
        else:
            y = conv(x)
            st.counts["dense_conv"] += 1
        st.rec(self.op_name, y)
        return y

    def active_cells(self, out_hw) -> torch.Tensor:
        """Output cells this op recomputes under the current mask (block-expanded)."""
        st, conv = self.state, self.inner
        cells = layer_mask(st.mask, tuple(out_hw))
        if conv.kernel_size[0] == 1 and conv.stride[0] == 1:
            return cells
        bo = conv_geometry(conv, st.block)["bo"]
        return expand_blocks(block_mask(cells, bo), bo, *out_hw)


class CachedTokenLinear(_Wrapper):
    kind = "linear"

    def forward(self, x):
        return self._timed(self._forward, x)

    def _forward(self, x):
        st, lin = self.state, self.inner
        if st.mode == "off" or x.ndim != 3:
            return lin(x)
        n = x.shape[1]
        st.op_shapes[self.op_name] = (tuple(x.shape), None)
        if st.mode == "edit" and st.sparse and n >= st.linear_min_cells:
            cached = st.cache.get(st.step, self.op_name, x.device)
            y = sparse_token_linear(x, lin, st.token_idx(st.tokens_hw(n), x.device), cached)
            st.counts["sparse_linear"] += 1
        else:
            y = lin(x)
            st.counts["dense_linear"] += 1
        st.rec(self.op_name, y)
        return y


class CachedGroupNorm(_Wrapper):
    kind = "groupnorm"

    def forward(self, x):
        return self._timed(self._forward, x)

    @staticmethod
    def scale_shift(gn: nn.GroupNorm, x: torch.Tensor):
        """Per-sample per-channel scale = gamma/sigma and shift = beta - mu*gamma/sigma."""
        B, C = x.shape[:2]
        G = gn.num_groups
        xf = x.reshape(B, G, -1).float()
        var, mean = torch.var_mean(xf, dim=2, unbiased=False)
        rstd = torch.rsqrt(var + gn.eps)
        rstd = rstd.repeat_interleave(C // G, dim=1)
        mean = mean.repeat_interleave(C // G, dim=1)
        w = gn.weight.float() if gn.weight is not None else torch.ones(C, device=x.device)
        b = gn.bias.float() if gn.bias is not None else torch.zeros(C, device=x.device)
        scale = w[None] * rstd
        shift = b[None] - mean * scale
        return scale.to(x.dtype), shift.to(x.dtype)

    def _forward(self, x):
        st, gn = self.state, self.inner
        if st.mode == "off":
            return gn(x)
        hw = x.shape[-2] * x.shape[-1] if x.ndim == 4 else 0
        approx = st.mode == "edit" and st.sparse and not st.exact and hw >= st.conv_min_cells
        if approx:
            scale = st.cache.get(st.step, self.op_name + ".scale", x.device)
            shift = st.cache.get(st.step, self.op_name + ".shift", x.device)
            y = torch.addcmul(shift[:, :, None, None], x, scale[:, :, None, None])
            st.counts["approx_groupnorm"] += 1
        else:
            y = gn(x)
            st.counts["exact_groupnorm"] += 1
        if st.record_cache is not None and st.mode in ("record", "edit"):
            scale, shift = self.scale_shift(gn, x)
            st.rec(self.op_name + ".scale", scale)
            st.rec(self.op_name + ".shift", shift)
        return y


class CachedTransformerBlock(_Wrapper):
    """Fused attn1 + attn2 + FF over the active tokens (queries sparse, K/V of attn1 from all
    tokens of the current input; attn2's K/V from the new text), scattered onto the cached
    block output."""

    kind = "attention"

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                timestep=None, cross_attention_kwargs=None, class_labels=None, added_cond_kwargs=None):
        kw = dict(attention_mask=attention_mask, encoder_hidden_states=encoder_hidden_states,
                  encoder_attention_mask=encoder_attention_mask, timestep=timestep,
                  cross_attention_kwargs=cross_attention_kwargs, class_labels=class_labels,
                  added_cond_kwargs=added_cond_kwargs)
        return self._timed(lambda h: self._forward(h, kw), hidden_states)

    def _supported(self, kw) -> bool:
        b = self.inner
        return (b.norm_type == "layer_norm" and b.pos_embed is None and not b.only_cross_attention
                and b._chunk_size is None and kw["attention_mask"] is None and kw["encoder_attention_mask"] is None
                and not kw["cross_attention_kwargs"])

    def _forward(self, h, kw):
        st, blk = self.state, self.inner
        if st.mode == "off":
            return blk(h, **kw)
        n = h.shape[1]
        st.op_shapes[self.op_name] = (tuple(h.shape), None)
        if st.mode == "edit" and st.sparse and n >= st.attn_min_cells and self._supported(kw):
            cached = st.cache.get(st.step, self.op_name, h.device)
            idx = st.token_idx(st.tokens_hw(n), h.device)
            out = cached.clone()
            if idx.numel():
                ha = gather_tokens(h, idx)
                if st.radical_attn:
                    na = blk.norm1(ha)
                    a = blk.attn1(na, encoder_hidden_states=na)
                else:
                    nfull = blk.norm1(h)
                    a = blk.attn1(gather_tokens(nfull, idx), encoder_hidden_states=nfull)
                ha = a + ha
                if blk.attn2 is not None:
                    ha = blk.attn2(blk.norm2(ha), encoder_hidden_states=kw["encoder_hidden_states"]) + ha
                ha = blk.ff(blk.norm3(ha)) + ha
                scatter_tokens(out, idx, ha)
            st.counts["sparse_attention"] += 1
        else:
            out = blk(h, **kw)
            st.counts["dense_attention"] += 1
        st.rec(self.op_name, out)
        return out


def _set_child(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def install(unet: nn.Module, state: EngineState) -> list[str]:
    """Swap wrappers into ``unet`` in place; returns the wrapped op names."""
    from diffusers.models.attention import BasicTransformerBlock

    if getattr(unet, "_fisedit_state", None) is not None:
        raise RuntimeError("FISEdit engine already installed on this UNet")
    targets = []
    skip_prefixes: list[str] = []
    for name, mod in unet.named_modules():
        if any(name.startswith(p) for p in skip_prefixes):
            continue
        if isinstance(mod, BasicTransformerBlock):
            targets.append((name, CachedTransformerBlock))
            skip_prefixes.append(name + ".")
        elif isinstance(mod, nn.Conv2d):
            targets.append((name, CachedConv2d))
        elif isinstance(mod, nn.GroupNorm):
            targets.append((name, CachedGroupNorm))
        elif isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in ("proj_in", "proj_out"):
            targets.append((name, CachedTokenLinear))
    for name, cls in targets:
        _set_child(unet, name, cls(name, unet.get_submodule(name), state))
    unet._fisedit_state = state
    return [n for n, _ in targets]


def uninstall(unet: nn.Module) -> None:
    for name, mod in list(unet.named_modules()):
        if isinstance(mod, _Wrapper):
            _set_child(unet, name, mod.inner)
    unet._fisedit_state = None


def wrappers(unet: nn.Module) -> dict:
    return {n: m for n, m in unet.named_modules() if isinstance(m, _Wrapper)}
