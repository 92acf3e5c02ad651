"""Sparse operators (after the authors' Hetu operators, branch `diffusers` of `Hankpipi/Hetu`):
block-sparse conv, sparse token-linear, sparse attention.

Every operator takes the *current* full input (fresh inside the mask, cached-derived outside),
the boolean output-cell mask of its layer and the cached output of the same op at the same
step, and returns a new tensor equal to the dense op on active cells and to the cache
elsewhere. Nothing is written into the cache.

Block-sparse conv: the output map is tiled into ``b x b`` blocks (``b`` = ``block`` for
stride 1; ``block // stride`` for strided convs, i.e. 1x1 output blocks for stride-2 at the
paper's b = 2). For each block with any active cell the input patch with its halo
((b-1)*stride + k) is gathered from the explicitly padded input (the conv's own zero padding,
plus zeros past the end for sizes not divisible by b), all patches run as one batched conv
without padding, and the results are scattered onto a copy of the cached output (gather and
scatter: ``impl.common.diffusion.windows``, which calibrate times).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from impl.common.diffusion.windows import (gather_cells, gather_tokens, gather_windows, pad_for_windows, scatter_blocks,
                                           scatter_cells, scatter_tokens, window_size)


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv_geometry(conv: torch.nn.Conv2d, block: int) -> dict:
    k = _pair(conv.kernel_size)
    s = _pair(conv.stride)
    p = _pair(conv.padding) if not isinstance(conv.padding, str) else None
    d = _pair(conv.dilation)
    if p is None or d != (1, 1) or conv.groups != 1 or conv.padding_mode != "zeros" or k[0] != k[1] or s[0] != s[1]:
        raise ValueError(f"sparse conv supports square, undilated, ungrouped, zero-padded convs; got {conv}")
    bo = max(1, block // s[0])
    return {"k": k[0], "s": s[0], "p": p, "bo": bo, "win": window_size(bo, s[0], k[0]), "step": bo * s[0]}


def block_mask(cell_mask: torch.Tensor, bo: int) -> torch.Tensor:
    """(H, W) bool -> (ceil(H/bo), ceil(W/bo)) bool: a block is active if any of its cells is."""
    H, W = cell_mask.shape
    nbh, nbw = math.ceil(H / bo), math.ceil(W / bo)
    m = F.pad(cell_mask.float()[None, None], (0, nbw * bo - W, 0, nbh * bo - H))
    return F.max_pool2d(m, bo)[0, 0] > 0


def expand_blocks(blocks: torch.Tensor, bo: int, H: int, W: int) -> torch.Tensor:
    """Block mask -> the output cells a block-sparse op recomputes (H, W) bool."""
    return blocks.repeat_interleave(bo, 0).repeat_interleave(bo, 1)[:H, :W]


def sparse_conv2d(x: torch.Tensor, conv: torch.nn.Conv2d, cell_mask: torch.Tensor, cached: torch.Tensor,
                  block: int = 2, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Block-sparse ``conv(x)``: dense value on every cell of an active block, ``cached`` elsewhere."""
    g = conv_geometry(conv, block)
    Ho, Wo = cached.shape[-2:]
    if cell_mask.shape != (Ho, Wo):
        raise ValueError(f"sparse conv: mask {tuple(cell_mask.shape)} does not match output {(Ho, Wo)}")
    if g["k"] == 1 and g["s"] == 1 and g["p"] == (0, 0):
        return _sparse_pointwise_conv(x, conv, cell_mask, cached)
    bo, win, step, s = g["bo"], g["win"], g["step"], g["s"]
    if blocks is None:
        blocks = block_mask(cell_mask, bo)
    idx = blocks.nonzero()
    out = cached.clone()
    if idx.numel() == 0:
        return out
    xp = pad_for_windows(x, g["p"], tuple(blocks.shape), step, win)
    y = F.conv2d(gather_windows(xp, idx, win, step), conv.weight, conv.bias, stride=s)  # (B*Nb, Cout, bo, bo)
    return scatter_blocks(out, idx, y, bo)


def _sparse_pointwise_conv(x, conv, cell_mask, cached):
    flat = cell_mask.flatten().nonzero().squeeze(1)
    out = cached.clone()
    if flat.numel() == 0:
        return out
    B, C = x.shape[:2]
    xa = gather_cells(x, flat)  # (B, C, Na)
    w = conv.weight.view(conv.weight.shape[0], C)
    y = torch.matmul(w, xa)
    if conv.bias is not None:
        y = y + conv.bias[:, None]
    return scatter_cells(out, flat, y)


def sparse_token_linear(x: torch.Tensor, linear: torch.nn.Linear, token_idx: torch.Tensor,
                        cached: torch.Tensor) -> torch.Tensor:
    """``linear`` on the active tokens of ``x`` (B, N, C), scattered onto ``cached`` (B, N, Cout)."""
    out = cached.clone()
    if token_idx.numel():
        scatter_tokens(out, token_idx, F.linear(gather_tokens(x, token_idx), linear.weight, linear.bias))
    return out
