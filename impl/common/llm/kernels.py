"""Torch reference multi-LoRA kernels with vLLM/Punica semantics (the oracle for fused paths).

Shapes: ``x`` [T, d_in]; ``A`` stacks [n, r, d_in]; ``B`` stacks [n, d_out, r]; ``idx`` [T] int
with -1 meaning "no LoRA" (those rows are skipped, never gathered with a negative index);
``scales`` [n] = alpha / r per adapter.

- :func:`shrink`:  t[i] = s[idx[i]] * x[i] @ A[idx[i]].T
- :func:`expand`:  y[i] += t[i] @ B[idx[i]].T
- :func:`bgmv`:    shrink + expand over one stack zero-padded to the batch's max rank (Punica
  BGMV: latency follows max r)
- :func:`sgmv`:    rows grouped in contiguous segments ``seg_lens`` with one adapter each
  (Punica SGMV); semantics = ``bgmv`` on ``repeat_interleave(seg_idx, seg_lens)``, computed as
  one dense GEMM pair per segment with :func:`lora_delta`
- :func:`mbgmv`:   S-LoRA style: rows grouped by adapter, each adapter at its own rank, no padding
  (latency follows sum r)

:func:`lora_delta` is the single per-adapter primitive; the CPU LoRA worker calls the same
function, so a CPU-computed delta is bit-identical to the segment kernel's.
"""
from __future__ import annotations

from typing import Sequence

import torch

from impl.common.api import ConfigError

PUNICA_RANKS = (16, 32, 64)


RANK_CHUNK = 32


def _ceil_chunk(r: int) -> int:
    return -(-r // RANK_CHUNK) * RANK_CHUNK


def lora_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """(s * x @ A.T) @ B.T for one adapter: x [T, d_in], A [r, d_in], B [d_out, r].

    Computed in rank chunks of ``RANK_CHUNK`` (the rank zero-padded to a multiple of it, as
    LoRAX pads for SGMV) with the chunks accumulated in order, so zero-padding an adapter to a
    larger rank adds exact zeros and leaves the result bit-identical (a single GEMM over a
    different inner dimension would round differently)."""
    r = A.shape[0]
    rp = _ceil_chunk(r)
    if rp != r:
        A, B = pad_rank(A, B, rp)
    y = None
    for c in range(0, rp, RANK_CHUNK):
        t = (x @ A[c:c + RANK_CHUNK].t()).mul_(scale)
        part = t @ B[:, c:c + RANK_CHUNK].t()
        y = part if y is None else y.add_(part)
    return y


def pad_rank(A: torch.Tensor, B: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad A [r, d_in] and B [d_out, r] to ``rank`` (>= r)."""
    r = A.shape[0]
    if rank < r:
        raise ValueError(f"cannot pad rank {r} down to {rank}")
    if rank == r:
        return A, B
    Ap = A.new_zeros((rank, A.shape[1]))
    Ap[:r] = A
    Bp = B.new_zeros((B.shape[0], rank))
    Bp[:, :r] = B
    return Ap, Bp


def stack_padded(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], rank: int = 0):
    """Stack per-adapter A/B zero-padded to max(rank, max r) -> ([n, R, d_in], [n, d_out, R])."""
    R = max([rank] + [a.shape[0] for a in As])
    pads = [pad_rank(a, b, R) for a, b in zip(As, Bs)]
    return torch.stack([p[0] for p in pads]), torch.stack([p[1] for p in pads])


def _rows(idx: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(idx >= 0, as_tuple=False).flatten()


def shrink(x: torch.Tensor, A: torch.Tensor, idx: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """t [T, R]; rows with idx -1 stay zero."""
    t = x.new_zeros((x.shape[0], A.shape[1]))
    rows = _rows(idx)
    if rows.numel():
        sel = idx[rows]
        t[rows] = torch.bmm(x[rows].unsqueeze(1), A[sel].transpose(1, 2)).squeeze(1) * scales[sel].unsqueeze(1)
    return t


def expand(y: torch.Tensor, t: torch.Tensor, B: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """y[i] += t[i] @ B[idx[i]].T for rows with idx >= 0 (in place; returns y)."""
    rows = _rows(idx)
    if rows.numel():
        sel = idx[rows]
        y[rows] += torch.bmm(t[rows].unsqueeze(1), B[sel].transpose(1, 2)).squeeze(1)
    return y


def bgmv(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, idx: torch.Tensor,
         scales: torch.Tensor) -> torch.Tensor:
    """Punica BGMV on stacks already padded to one rank (see :func:`stack_padded`): shrink and
    expand per rank chunk, accumulated in order (padding chunks add exact zeros)."""
    R = A.shape[1]
    Rp = _ceil_chunk(R)
    if Rp != R:
        A = torch.cat([A, A.new_zeros((A.shape[0], Rp - R, A.shape[2]))], 1)
        B = torch.cat([B, B.new_zeros((B.shape[0], B.shape[1], Rp - R))], 2)
    rows = _rows(idx)
    if not rows.numel():
        return y
    sel = idx[rows]
    xr = x[rows].unsqueeze(1)
    acc = None
    for c in range(0, Rp, RANK_CHUNK):
        t = torch.bmm(xr, A[sel, c:c + RANK_CHUNK].transpose(1, 2)) * scales[sel].view(-1, 1, 1)
        part = torch.bmm(t, B[sel][:, :, c:c + RANK_CHUNK].transpose(1, 2))
        acc = part if acc is None else acc.add_(part)
    y[rows] += acc.squeeze(1)
    return y


def sgmv(y: torch.Tensor, x: torch.Tensor, As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor],
         scales: Sequence[float], seg_idx: Sequence[int], seg_lens: Sequence[int]) -> torch.Tensor:
    """Segments of contiguous rows, one adapter each (index -1 = no LoRA). In place on y."""
    start = 0
    for a, n in zip(seg_idx, seg_lens):
        if a >= 0 and n:
            y[start:start + n] += lora_delta(x[start:start + n], As[a], Bs[a], float(scales[a]))
        start += n
    if start != x.shape[0]:
        raise ValueError(f"sgmv: segment lengths sum to {start}, x has {x.shape[0]} rows")
    return y


def mbgmv(y: torch.Tensor, x: torch.Tensor, As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor],
          scales: Sequence[float], idx: torch.Tensor) -> torch.Tensor:
    """S-LoRA MBGMV: rows grouped by adapter, each at its own rank (no padding). In place on y."""
    for a in sorted(set(idx.tolist())):
        if a < 0:
            continue
        rows = torch.nonzero(idx == a, as_tuple=False).flatten().to(y.device)
        y.index_add_(0, rows, lora_delta(x[rows], As[a], Bs[a], float(scales[a])))
    return y


def check_kernel_rank(kernel: str, rank: int, where: str = "adapter") -> None:
    """Punica's upstream kernels support only ranks 16/32/64 (punica #17)."""
    if kernel == "bgmv_punica" and rank not in PUNICA_RANKS:
        raise ConfigError(f"{where}: rank {rank} is not supported by the Punica BGMV kernel "
                          f"(supported: {', '.join(map(str, PUNICA_RANKS))})")
