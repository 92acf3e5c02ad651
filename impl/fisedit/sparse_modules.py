"""The sparse engine: wrapper modules swapped into a real diffusers UNet.

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

Two engines share the wrappers (``EngineState.engine``, ``system.engine``): ``reference``
(:mod:`.sparse`: masks turned into indices by ``nonzero`` inside every call, the cached map
cloned per op; the engine the CPU results were first measured with and the sim's
``sim_engine: reference`` prices) and ``fast`` (:mod:`.fast` over :mod:`.plan`: indices built
once per edit on the job's device, persistent output buffers, GroupNorm + SiLU folded into the
conv gathers of each ResnetBlock2D, no host synchronisation inside a step).
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

from impl.fisedit import fast
from impl.fisedit.cache import ActivationCache
from impl.fisedit.mask import layer_mask
from impl.fisedit.plan import PlanSet
from impl.fisedit.sparse import block_mask, conv_geometry, expand_blocks, sparse_conv2d, sparse_token_linear


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
    engine: str = "fast"  # fast | reference
    dense_tile_fraction: float = 1.0  # fast: an op runs dense when its tiles cover >= this share of its map
    device: Optional[torch.device] = None  # the job's device (the pipeline's); None = the inputs'
    dtype: torch.dtype = torch.float32
    cl_gather: Optional[bool] = None  # fast: None = channels-last tile gathers on CPU, NCHW on CUDA (tests force both)
    edit_version: int = 0  # bumped when the mask, block or cache changes: fast buffers/plans per edit
    _memo: dict = field(default_factory=dict)
    _plans: Optional[PlanSet] = None
    _step_dev: Optional[torch.Tensor] = None

    def __post_init__(self):
        H0, W0 = self.latent_hw
        base = H0 * W0
        self.conv_min_cells = self.conv_min_cells or max(1, base // 16)
        self.linear_min_cells = self.linear_min_cells or max(1, base // 16)
        self.attn_min_cells = self.attn_min_cells or max(1, base // 4)

    def set_mask(self, mask: Optional[torch.Tensor]) -> None:
        new = None if mask is None else mask.bool().cpu()
        same = (new is None and self.mask is None) or (
            new is not None and self.mask is not None and new.shape == self.mask.shape and torch.equal(new, self.mask))
        self.mask = new
        if not same:
            self._memo.clear()
            self._plans = None
            self.edit_version += 1

    def set_block(self, block: int) -> None:
        self.block = int(block)
        self._memo.clear()
        self._plans = None
        self.edit_version += 1

    def set_cache(self, cache) -> None:
        if cache is not self.cache:
            self.edit_version += 1
        self.cache = cache

    @property
    def fast(self) -> bool:
        return self.engine == "fast"

    @property
    def plans(self) -> PlanSet:
        """The fast engine's index plans for the current mask (built on first use, per edit)."""
        if (self._plans is None or self._plans.dense_tile_fraction != self.dense_tile_fraction
                or self._plans.block != self.block or self._plans.cl_gather != self.cl_gather):
            self._plans = PlanSet(self.mask, self.block, self.device or "cpu", self.dense_tile_fraction, self.dtype,
                                  self.cl_gather)
        return self._plans

    @property
    def step_dev(self) -> torch.Tensor:
        """The device-side step index (row of the consolidated cache) the fast loads read."""
        dev = torch.device(self.device or "cpu")
        if self._step_dev is None or self._step_dev.device != dev:
            self._step_dev = torch.zeros(1, dtype=torch.long, device=dev)
        return self._step_dev

    def set_step_index(self) -> None:
        """Write this step's cache row into :attr:`step_dev` (one device op, no sync); called
        before each UNet call, outside any captured graph."""
        if self.fast and self.cache is not None and getattr(self.cache, "rows", None):
            row = self.cache.rows.get(self.step)
            if row is not None:
                self.step_dev.fill_(row)

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

    def rec(self, name: str, t: torch.Tensor, copy: bool = False) -> None:
        if self.record_cache is not None and self.mode in ("record", "edit"):
            self.record_cache.put(self.step, name, t, copy=copy)


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
        if st.mode == "edit" and st.sparse and Ho * Wo >= st.conv_min_cells and st.fast:
            y = self._fast_forward(x, (H, W), (Ho, Wo))
            st.rec(self.op_name, y, copy=True)
            return y
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

    def _fast_forward(self, x, in_hw, out_hw):
        st, conv = self.state, self.inner
        g = conv_geometry(conv, st.block)
        if g["k"] == 1 and g["s"] == 1 and g["p"] == (0, 0):
            plan = st.plans.cells(out_hw)
            if not plan.dense:
                st.counts["sparse_conv"] += 1
                return fast.pointwise_conv(self, st, x, conv, plan)
        else:
            plan = st.plans.window(in_hw, out_hw, g["k"], g["s"], g["p"][0], g["bo"])
            if not plan.dense:
                st.counts["sparse_conv"] += 1
                return fast.window_conv(self, st, x, conv, plan)
        st.counts["dense_conv"] += 1
        return conv(x)

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
        if st.mode == "edit" and st.sparse and n >= st.linear_min_cells and st.fast:
            plan = st.plans.cells(st.tokens_hw(n))
            if plan.dense:
                y = lin(x)
                st.counts["dense_linear"] += 1
            else:
                y = fast.token_linear(self, st, x, lin, plan)
                st.counts["sparse_linear"] += 1
            st.rec(self.op_name, y, copy=True)
            return y
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
        if approx and st.fast:
            y = fast.approx_groupnorm(self, st, x)
            st.counts["approx_groupnorm"] += 1
        elif approx:
            scale = st.cache.get(st.step, self.op_name + ".scale", x.device)
            shift = st.cache.get(st.step, self.op_name + ".shift", x.device)
            y = torch.addcmul(shift[:, :, None, None], x, scale[:, :, None, None])
            st.counts["approx_groupnorm"] += 1
        else:
            y = gn(x)
            st.counts["exact_groupnorm"] += 1
        self.record_stats(x)
        return y

    def record_stats(self, x):
        st = self.state
        if st.record_cache is not None and st.mode in ("record", "edit"):
            scale, shift = self.scale_shift(self.inner, x)
            st.rec(self.op_name + ".scale", scale)
            st.rec(self.op_name + ".shift", shift)


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
        if st.mode == "edit" and st.sparse and n >= st.attn_min_cells and self._supported(kw) and st.fast:
            plan = st.plans.cells(st.tokens_hw(n))
            if plan.dense:
                out = blk(h, **kw)
                st.counts["dense_attention"] += 1
            else:
                out = fast.transformer_block(self, st, blk, h, kw, plan)
                st.counts["sparse_attention"] += 1
            st.rec(self.op_name, out, copy=True)
            return out
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


class CachedResnetBlock(_Wrapper):
    """Fast engine only: a ResnetBlock2D whose sparse step folds norm1/norm2 + SiLU (and the
    time embedding) into its convs' tile gathers (:func:`fast.resnet_forward`). Its children
    stay wrapped: record, dense and exact-GroupNorm steps run the block's own forward."""

    kind = "resnet"

    def forward(self, input_tensor, temb, *args, **kwargs):
        st, blk = self.state, self.inner
        if (st.fast and st.mode == "edit" and st.sparse and not st.exact and not args and not kwargs
                and not blk.training and input_tensor.shape[-2] * input_tensor.shape[-1] >= st.conv_min_cells
                and self._foldable()):
            return fast.resnet_forward(self, st, input_tensor, temb)
        return blk(input_tensor, temb, *args, **kwargs)

    def _foldable(self) -> bool:
        if not hasattr(self, "_fold_ok"):
            self._fold_ok = resnet_foldable(self.inner)
        return self._fold_ok


def resnet_foldable(blk) -> bool:
    if not (isinstance(blk.norm1, CachedGroupNorm) and isinstance(blk.norm2, CachedGroupNorm)
            and isinstance(blk.conv1, CachedConv2d) and isinstance(blk.conv2, CachedConv2d)):
        return False
    if blk.upsample is not None or blk.downsample is not None or blk.time_embedding_norm != "default":
        return False
    if not isinstance(blk.nonlinearity, torch.nn.SiLU) or getattr(blk, "skip_time_act", False):
        return False
    for c in (blk.conv1.inner, blk.conv2.inner):
        try:
            g = conv_geometry(c, 2)
        except ValueError:
            return False
        if g["s"] != 1:
            return False
    return True


def _set_child(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def install(unet: nn.Module, state: EngineState) -> list[str]:
    """Swap wrappers into ``unet`` in place; returns the wrapped op names."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D

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
        elif isinstance(mod, ResnetBlock2D) and state.fast:
            targets.append((name, CachedResnetBlock))
    targets.sort(key=lambda t: -t[0].count("."))  # children before their parents
    for name, cls in targets:
        _set_child(unet, name, cls(name, unet.get_submodule(name), state))
    unet._fisedit_state = state
    return [n for n, _ in targets]


def uninstall(unet: nn.Module) -> None:
    found = [(m.op_name, m) for m in unet.modules() if isinstance(m, _Wrapper)]
    for name, mod in sorted(found, key=lambda t: t[0].count(".")):  # parents first: children keep their names
        _set_child(unet, name, mod.inner)
    unet._fisedit_state = None


def wrappers(unet: nn.Module) -> dict:
    return {m.op_name: m for m in unet.modules() if isinstance(m, _Wrapper)}
