"""Gathered-window convolution primitives: the data movement of a block-sparse conv.

A block-sparse conv (FISEdit's engine: its authors' code, branch
`diffusers` of `Hankpipi/Hetu`) tiles its output into ``bo x bo``
blocks, gathers for each active block the input window with its halo
(``win = (bo - 1) * stride + k``) from the explicitly padded input, runs every window as one
batched unpadded conv, and scatters the ``bo x bo`` results onto the output. The gather and
scatter live here, not in the engine, so that ``system=harness/calibrate`` times exactly the engine's
kernels (advanced indexing over an ``unfold`` view): on a CPU they move a window's short rows
at a small fraction of a streaming copy's bandwidth, and the conv on tiny spatial tiles runs
well below the dense conv's FLOP rate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def window_size(bo: int, stride: int, k: int) -> int:
    """Input window side of a ``bo x bo`` output block: the block's span plus the halo."""
    return (bo - 1) * stride + k


def pad_for_windows(x: torch.Tensor, padding: tuple, nblocks: tuple, step: int, win: int) -> torch.Tensor:
    """``x`` with the conv's own zero padding plus zeros past the end, so every block's window
    (``nblocks`` = (rows, cols) of blocks, ``step`` = bo * stride apart) lies inside."""
    H, W = x.shape[-2:]
    ph, pw = padding
    need_h = (nblocks[0] - 1) * step + win
    need_w = (nblocks[1] - 1) * step + win
    return F.pad(x, (pw, max(0, need_w - W - pw), ph, max(0, need_h - H - ph)))


def gather_windows(xp: torch.Tensor, idx: torch.Tensor, win: int, step: int) -> torch.Tensor:
    """(B, C, Hp, Wp) padded input, (Nb, 2) block indices -> (B * Nb, C, win, win) windows,
    batch-major (window ``b * Nb + n`` is block ``n`` of image ``b``)."""
    B, C = xp.shape[:2]
    windows = xp.unfold(2, win, step).unfold(3, win, step)  # (B, C, nbh, nbw, win, win), a view
    patches = windows[:, :, idx[:, 0], idx[:, 1]]  # (B, C, Nb, win, win): the only gather
    return patches.permute(0, 2, 1, 3, 4).reshape(B * idx.shape[0], C, win, win)


def scatter_blocks(out: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, bo: int) -> torch.Tensor:
    """Write ``y`` (B * Nb, Cout, bo, bo), as :func:`gather_windows` orders it, onto ``out``
    (B, Cout, Ho, Wo) at the blocks ``idx``; returns the result (``out`` itself, written in
    place, when Ho and Wo are multiples of ``bo``; else a new tensor)."""
    B, Co, Ho, Wo = out.shape
    nb = idx.shape[0]
    nbh, nbw = -(-Ho // bo), -(-Wo // bo)
    yb = y.reshape(B, nb, Co, bo, bo).permute(1, 0, 2, 3, 4)  # (Nb, B, Cout, bo, bo)
    bi, bj = idx[:, 0], idx[:, 1]
    if Ho % bo == 0 and Wo % bo == 0:
        out.view(B, Co, nbh, bo, nbw, bo)[:, :, bi, :, bj, :] = yb
        return out
    padded = F.pad(out, (0, nbw * bo - Wo, 0, nbh * bo - Ho))
    padded.view(B, Co, nbh, bo, nbw, bo)[:, :, bi, :, bj, :] = yb
    return padded[:, :, :Ho, :Wo].contiguous()


# The cell and token gathers of the engine's other sparse ops: a 1x1 conv picks the active
# cells of every channel (a strided gather along the flattened map), a token op the active
# rows of a (B, N, C) sequence (C-long contiguous rows). Calibrate times these same functions.

def gather_cells(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W), (Na,) flat cell indices -> (B, C, Na)."""
    return x.flatten(2)[:, :, flat]


def scatter_cells(out: torch.Tensor, flat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Write ``y`` (B, Cout, Na) onto ``out`` (B, Cout, H, W) at the cells ``flat``, in place."""
    out.view(out.shape[0], out.shape[1], -1)[:, :, flat] = y
    return out


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(B, N, C), (Na,) token indices -> (B, Na, C)."""
    return x[:, idx]


def scatter_tokens(out: torch.Tensor, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Write ``y`` (B, Na, C) onto ``out`` (B, N, C) at the tokens ``idx``, in place."""
    out[:, idx] = y
    return out
