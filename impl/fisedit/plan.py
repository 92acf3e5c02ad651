"""Index plans of the fast sparse engine: a mask becomes index tensors once per edit.

When an edit's mask is set, every sparse op asks :class:`PlanSet` for the plan of its geometry;
a plan is built once per edit and key (SIGE's "reduce the mask to tile origins once, share it
across layers"; the authors' Hetu engine caches its indices per shape) and lives on the job's
device. Building one uses ``nonzero`` on the host-side mask; using one never does: a step
only runs ``aten.index`` / ``index_select`` / ``index_put_`` / ``index_copy_`` with the prebuilt
tensors, and every data-dependent decision (empty active set, dense fallback when the tiles
cover most of the map, borders that need zeroing) is taken here, at plan time.

Plans are plain data (:class:`WindowPlan`, :class:`CellPlan`): print one to see its tiles.

- :class:`WindowPlan` (a k x k conv, stride s, padding p, ``bo x bo`` output tiles): ``rows`` /
  ``cols`` (Nt, win, win) input coordinates of each tile's window with its halo
  (``win = (bo - 1) * s + k``), clamped into the input; ``valid`` (Nt, 1, win, win) is 0 where
  the window reads the conv's zero padding (only when some tile touches a border);
  ``out_rows`` / ``out_cols`` (Nt, bo, bo) the output cells a tile writes.
- :class:`CellPlan` (a 1x1 conv, a token linear, a transformer block): ``flat`` (Na,) active
  cell indices of the flattened map.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from impl.fisedit.mask import layer_mask
from impl.fisedit.sparse import block_mask


@dataclass
class WindowPlan:
    in_hw: tuple
    out_hw: tuple
    k: int
    s: int
    p: int
    bo: int
    win: int
    n_tiles: int
    coverage: float  # output cells the tiles cover / all output cells
    dense: bool  # run this op dense (decided here; reason in ``why``)
    why: str = ""
    rows: Optional[torch.Tensor] = None
    cols: Optional[torch.Tensor] = None
    valid: Optional[torch.Tensor] = None  # None: no tile reads the padding
    out_rows: Optional[torch.Tensor] = None
    out_cols: Optional[torch.Tensor] = None
    cl_gather: bool = False  # gather channels-last (CPU) or NCHW (CUDA): fast.window_conv

    @property
    def empty(self) -> bool:
        return self.n_tiles == 0


@dataclass
class CellPlan:
    hw: tuple
    n_active: int
    coverage: float
    dense: bool
    why: str = ""
    flat: Optional[torch.Tensor] = None

    @property
    def empty(self) -> bool:
        return self.n_active == 0


def window_plan(mask: torch.Tensor, in_hw, out_hw, k: int, s: int, p: int, bo: int, device,
                dense_tile_fraction: float = 1.0, dtype=torch.float32, cl_gather: Optional[bool] = None) -> WindowPlan:
    """Tiles of one conv geometry under the latent ``mask`` (host bool)."""
    Hi, Wi = in_hw
    Ho, Wo = out_hw
    win = (bo - 1) * s + k
    base = dict(in_hw=tuple(in_hw), out_hw=tuple(out_hw), k=k, s=s, p=p, bo=bo, win=win)
    if Ho % bo or Wo % bo:
        return WindowPlan(**base, n_tiles=0, coverage=1.0, dense=True,
                          why=f"output {Ho}x{Wo} not divisible by the {bo}x{bo} tile")
    blocks = block_mask(layer_mask(mask, (Ho, Wo)), bo)
    idx = blocks.nonzero()  # plan time, host tensor: once per edit and geometry
    nt = int(idx.shape[0])
    cov = nt * bo * bo / (Ho * Wo)
    if nt and cov >= dense_tile_fraction:
        return WindowPlan(**base, n_tiles=nt, coverage=cov, dense=True,
                          why=f"tiles cover {cov:.2f} >= dense_tile_fraction {dense_tile_fraction}")
    if nt == 0:
        return WindowPlan(**base, n_tiles=0, coverage=0.0, dense=False, why="no active tile")
    r0 = idx[:, 0] * bo * s - p
    c0 = idx[:, 1] * bo * s - p
    a = torch.arange(win)
    rows = r0[:, None, None] + a[None, :, None]  # (Nt, win, 1)
    cols = c0[:, None, None] + a[None, None, :]  # (Nt, 1, win)
    rows, cols = torch.broadcast_tensors(rows, cols)
    valid = (rows >= 0) & (rows < Hi) & (cols >= 0) & (cols < Wi)
    b = torch.arange(bo)
    out_rows, out_cols = torch.broadcast_tensors((idx[:, 0] * bo)[:, None, None] + b[None, :, None],
                                                 (idx[:, 1] * bo)[:, None, None] + b[None, None, :])
    dev = torch.device(device)
    return WindowPlan(**base, n_tiles=nt, coverage=cov, dense=False,
                      rows=rows.clamp(0, Hi - 1).contiguous().to(dev), cols=cols.clamp(0, Wi - 1).contiguous().to(dev),
                      valid=None if bool(valid.all()) else valid[:, None].to(dtype).to(dev),
                      out_rows=out_rows.contiguous().to(dev), out_cols=out_cols.contiguous().to(dev),
                      cl_gather=dev.type == "cpu" if cl_gather is None else cl_gather)


def cell_plan(mask: torch.Tensor, hw, device, dense_tile_fraction: float = 1.0) -> CellPlan:
    cells = layer_mask(mask, tuple(hw)).flatten()
    flat = cells.nonzero().squeeze(1)  # plan time
    n = int(flat.numel())
    cov = n / cells.numel()
    if n and cov >= dense_tile_fraction:
        return CellPlan(tuple(hw), n, cov, True, why=f"cells cover {cov:.2f} >= dense_tile_fraction {dense_tile_fraction}")
    return CellPlan(tuple(hw), n, cov, False, why="" if n else "no active cell",
                    flat=flat.to(torch.device(device)) if n else None)


class PlanSet:
    """The plans of one edit (one mask, one block size), by geometry; dropped when the mask changes."""

    def __init__(self, mask: Optional[torch.Tensor], block: int, device, dense_tile_fraction: float, dtype,
                 cl_gather: Optional[bool] = None):
        self.cl_gather = cl_gather  # None: channels-last gathers on a CPU, NCHW on CUDA
        self.mask = mask
        self.block = block
        self.device = torch.device(device)
        self.dense_tile_fraction = dense_tile_fraction
        self.dtype = dtype
        self.plans: dict = {}
        self.version = 0

    def window(self, in_hw, out_hw, k, s, p, bo) -> WindowPlan:
        key = ("win", tuple(in_hw), tuple(out_hw), k, s, p, bo)
        if key not in self.plans:
            self.plans[key] = window_plan(self.mask, in_hw, out_hw, k, s, p, bo, self.device,
                                          self.dense_tile_fraction, self.dtype, self.cl_gather)
        return self.plans[key]

    def cells(self, hw) -> CellPlan:
        key = ("cells", tuple(hw))
        if key not in self.plans:
            self.plans[key] = cell_plan(self.mask, hw, self.device, self.dense_tile_fraction)
        return self.plans[key]

    def summary(self) -> list:
        """One row per plan (for records): geometry, tiles, coverage, dense and why."""
        out = []
        for key, p in self.plans.items():
            if isinstance(p, WindowPlan):
                out.append({"kind": "window", "out_hw": list(p.out_hw), "k": p.k, "s": p.s, "bo": p.bo,
                            "tiles": p.n_tiles, "coverage": round(p.coverage, 4), "dense": p.dense, "why": p.why})
            else:
                out.append({"kind": "cells", "hw": list(p.hw), "cells": p.n_active, "coverage": round(p.coverage, 4),
                            "dense": p.dense, "why": p.why})
        return out
