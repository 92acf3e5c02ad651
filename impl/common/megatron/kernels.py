"""Kernel times by shape, read from a hardware profile's tables (:class:`~impl.common.hardware.KernelTables`).

Why tables: a GEMM of 2,048 rows runs at 0.77-0.95 of its large-row rate on Hopper, one of 128
rows at 0.2-0.45, and causal flash attention's rate triples from 1K to 32K tokens; one efficiency
constant per kernel cannot follow both ends (Calculon's efficiency-by-size tables, vTrain's and
SimAI/AICB's measured per-op times). The tables hold what a probe measures
(``mlsys-bench-probe``, :mod:`bench.probe`) or what the shared H200 file gives
(``impl/common/megatron/data/h200_kernels_2026-12-04.jsonl``).

- GEMM ``x @ W.T`` (m x k by n x k): a series per (n, k), seconds at measured m; between two m,
  log-log interpolation; below the smallest m, the first segment's log-log slope (few rows stream
  the weights: time barely falls); above the largest m, the last measured rate (time ~ m). A
  shape (n, k) without its own series takes each series' rate at the same output size
  (m' = m n / n_i) and a weighted geometric mean over the series, weights 1 / (1 + d^2) ** 2 by
  the log-distance d of (n, k) to (n_i, k_i) (an exact match is that series alone).
- Backward GEMMs are GEMMs too: the input gradient of ``x @ W.T`` is (m, n) @ (n, k) = shape
  (m rows, k out, n inner), the weight gradient (n, m) @ (m, k) = (n rows, k out, m inner); both
  are looked up in the same tables (a probe measures those shapes; the shared file has forward
  shapes only, so its backward rates are those of the nearest forward shapes).
- Causal attention: per series (heads, head_dim), forward and backward seconds at measured s,
  log-log in s (below: the first segment's slope, above: the last rate); other head counts and
  head dims scale linearly (a batch of independent heads; the FLOPs are linear in head_dim).

Carrying tables to another GPU (:func:`carried`): compute-bound times scale by the bf16 peak
ratio, memory-bound ones by the HBM bandwidth ratio, as a roofline: t' = max(t x peak / peak',
bytes / bw') where bytes are the GEMM's operands and output read or written once. For the H100
from the H200 (the same chip, clocks and bf16 peak, 3.35 vs 4.8 TB/s): t' = max(t, bytes / 3.35 TB/s).
"""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from impl.common.api import ConfigError
from impl.common.hardware import AttnSeries, GemmSeries, HardwareProfile, KernelTables

BF16 = 2.0


def _interp(x, xs, ys, power: float) -> np.ndarray:
    """Log-log interpolation of ys(xs) at x. Below xs[0]: the first segment's log-log slope;
    above xs[-1]: ys[-1] (x / xs[-1]) ** power (the last measured rate: power 1 for a GEMM's rows,
    2 for causal attention's length). x <= 0 gives 0."""
    x = np.asarray(x, dtype=float)
    lx, ly = np.log(np.asarray(xs, dtype=float)), np.log(np.asarray(ys, dtype=float))
    safe = np.log(np.maximum(x, 1e-30))
    y = np.interp(safe, lx, ly)
    if len(lx) > 1:
        slope = (ly[1] - ly[0]) / (lx[1] - lx[0])
        y = np.where(safe < lx[0], ly[0] + slope * (safe - lx[0]), y)
    y = np.where(safe > lx[-1], ly[-1] + power * (safe - lx[-1]), y)
    return np.where(x > 0, np.exp(y), 0.0)


def gemm_s(tables: KernelTables, m, n, k) -> np.ndarray:
    """Seconds of ``x @ W.T`` with x of m rows and k columns, W of n x k (arrays broadcast)."""
    if not tables.gemm:
        raise ConfigError(f"kernels: no GEMM table ({tables.source or 'profile'})")
    m, n, k = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (m, n, k)))
    flops = 2.0 * m * n * k
    logs, weights = [], []
    for g in tables.gemm:
        m_eq = m * n / g.n  # the same output size on that series
        t = _interp(m_eq, g.m, g.s, 1.0)
        rate = 2.0 * m_eq * g.n * g.k / np.maximum(t, 1e-30)
        d = np.hypot(np.log(n / g.n), np.log(k / g.k))
        logs.append(np.log(np.maximum(rate, 1e-30)))
        weights.append(1.0 / np.maximum(d, 1e-12) ** 2)  # an exact (n, k) match is that series alone
    w = np.stack(weights)
    rate = np.exp((w * np.stack(logs)).sum(axis=0) / w.sum(axis=0))
    return np.where(m > 0, flops / rate, 0.0)


def gemm_fwd_bwd_s(tables: KernelTables, m, n: int, k: int, wgrad: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward seconds of a linear ``y = x @ W.T`` (input and, with ``wgrad``, weight
    gradient) for m rows: see the module doc for the backward shapes."""
    m = np.asarray(m, dtype=float)
    fwd = gemm_s(tables, m, n, k)
    bwd = gemm_s(tables, m, k, n)  # dx = dy @ W: m rows, k out, n inner
    if wgrad:
        # dW = dy^T @ x: n rows, k out, m inner.
        bwd = bwd + np.where(m > 0, gemm_s(tables, float(n), float(k), np.maximum(m, 1.0)), 0.0)
    return fwd, bwd


def attn_fwd_bwd_s(tables: KernelTables, s_eff, sq, heads: float, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention over documents whose squared lengths sum to ``sq``, with the length-weighted
    mean length ``s_eff`` = sum s^2 / sum s (exact for one document; a packed row of documents of
    one length too), on ``heads`` heads of ``head_dim``: forward and backward seconds, t(s_eff) x
    sq / s_eff^2 scaled by heads and head_dim from the nearest series."""
    if not tables.attn:
        raise ConfigError(f"kernels: no attention table ({tables.source or 'profile'})")
    a = min(tables.attn, key=lambda x: abs(math.log(x.head_dim / head_dim)))
    s_eff = np.asarray(s_eff, dtype=float)
    sq = np.asarray(sq, dtype=float)
    scale = heads / a.heads * head_dim / a.head_dim
    ok = s_eff > 0
    denom = np.where(ok, s_eff * s_eff, 1.0)
    fwd = np.where(ok, _interp(s_eff, a.s, a.fwd_s, 2.0) * sq / denom, 0.0) * scale
    bwd = np.where(ok, _interp(s_eff, a.s, a.bwd_s, 2.0) * sq / denom, 0.0) * scale
    return fwd, bwd


# ---- tables from measurements, and carried to another GPU ------------------------------------

def gemm_bytes(m: float, n: int, k: int) -> float:
    """bf16 operands and output of ``x @ W.T``, each read or written once."""
    return BF16 * (m * k + n * k + m * n)


def tables_from_jsonl(path: str | pathlib.Path, source: str = "") -> KernelTables:
    """KernelTables from a probe file (``kind: gemm`` / ``attn`` lines, the shared H200 file's
    format: gemm ``m, n, k, s``; attn ``s, heads, head_dim, fwd_s, fwdbwd_s``)."""
    p = pathlib.Path(path)
    series: dict = {}
    attn: dict = {}
    with open(p, encoding="utf-8") as fh:
        for i, text in enumerate(fh, 1):
            if not text.strip():
                continue
            try:
                r = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}:{i}: json: not valid JSON ({e.msg})") from None
            kind = r.get("kind")
            try:
                if kind == "gemm":
                    key = (int(r["n"]), int(r["k"]))
                    g = series.setdefault(key, GemmSeries(n=key[0], k=key[1], label=str(r.get("shape", ""))))
                    g.m.append(int(r["m"]))
                    g.s.append(float(r["s"]))
                elif kind == "attn":
                    key = (int(r["heads"]), int(r["head_dim"]))
                    a = attn.setdefault(key, AttnSeries(heads=key[0], head_dim=key[1]))
                    a.s.append(int(r["s"]))
                    a.fwd_s.append(float(r["fwd_s"]))
                    a.bwd_s.append(float(r["fwdbwd_s"]) - float(r["fwd_s"]))
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(f"{p}:{i}: {kind}: missing or bad field ({e})") from None
    for g in series.values():
        o = np.argsort(g.m)
        g.m, g.s = [g.m[j] for j in o], [g.s[j] for j in o]
    for a in attn.values():
        o = np.argsort(a.s)
        a.s, a.fwd_s, a.bwd_s = [a.s[j] for j in o], [a.fwd_s[j] for j in o], [a.bwd_s[j] for j in o]
    if not series or not attn:
        raise ConfigError(f"{p}: needs gemm and attn lines (has {len(series)} GEMM shapes, {len(attn)} attention)")
    return KernelTables(source=source or str(p.name), gemm=list(series.values()), attn=list(attn.values()))


def carried(tables: KernelTables, base_peak: float, base_bw: float, target: HardwareProfile,
            how: str = "") -> KernelTables:
    """The tables carried from a GPU of bf16 peak ``base_peak`` and HBM ``base_bw`` to ``target``
    by the roofline rule of the module doc."""
    peak = (target.peak_flops or {}).get("bf16")
    bw = target.memory_bw_bytes_per_s
    if not peak or not bw > 0:
        raise ConfigError(f"hardware {target.name}: needs peak_flops.bf16 and memory_bw_bytes_per_s to carry kernel tables")
    c = base_peak / peak
    gemm = [GemmSeries(n=g.n, k=g.k, label=g.label, m=list(g.m),
                       s=[max(t * c, gemm_bytes(m, g.n, g.k) / bw) for m, t in zip(g.m, g.s)]) for g in tables.gemm]
    attn = []
    for a in tables.attn:
        io = [4.0 * BF16 * s * a.heads * a.head_dim for s in a.s]  # q, k, v, o
        attn.append(AttnSeries(heads=a.heads, head_dim=a.head_dim, s=list(a.s),
                               fwd_s=[max(t * c, b / bw) for t, b in zip(a.fwd_s, io)],
                               bwd_s=[max(t * c, 2 * b / bw) for t, b in zip(a.bwd_s, io)]))
    note = how or (f"carried: compute x {c:.4g} (bf16 peak {base_peak:.4g} -> {peak:.4g}), memory-bound at "
                   f"{bw:.4g} B/s (was {base_bw:.4g})")
    return KernelTables(source=f"{tables.source}; {note}", gemm=gemm, attn=attn)


def flat_tables(hw: HardwareProfile, dtype: str = "bf16") -> KernelTables:
    """Tables of a measured host profile (``system=harness/calibrate``: its peak is the matmul rate it
    achieved): that rate at every shape."""
    rate = (hw.peak_flops or {}).get(dtype)
    if not rate:
        raise ConfigError(f"hardware {hw.name}: no {dtype} FLOP/s to price Megatron with")
    ms = [1, 1 << 20]
    ss = [1, 1 << 20]
    return KernelTables(source=f"flat: {rate:.4g} FLOP/s (measured {dtype} matmul rate of {hw.name})",
                        gemm=[GemmSeries(n=4096, k=4096, m=ms, s=[2.0 * m * 4096 * 4096 / rate for m in ms])],
                        attn=[AttnSeries(heads=32, head_dim=128, s=ss,
                                         fwd_s=[2.0 * s * s * 4096 / rate for s in ss],
                                         bwd_s=[5.0 * s * s * 4096 / rate for s in ss])])
