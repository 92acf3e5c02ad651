"""Fit what the Megatron step model cannot derive or look up (:class:`~impl.common.hardware.MegatronKnobs`)
to measured launches, and price launches with a profile. Fitting only writes knobs; pricing only
reads them; every error quoted is on launches the fit did not see (K folds). Kernel times come
from the profile's tables and activation bytes from the modules (:mod:`.kernels`,
:mod:`.activations`): the knobs are what is left, each with a physical range (:func:`knob_ranges`);
the fit is bounded by them and reports any knob at its bound (``at_bound``).

- Time (7 knobs: GEMM, attention and memory-bound time over the tables, intra- and inter-node bus
  bandwidth, per-layer and per-iteration overhead): bounded least squares on
  log(predicted / measured) iteration time over every timed launch, pad and pack alike (soft-L1
  loss: a launch slowed by a neighbour's job does not pull every knob).
- Memory (3 knobs: allocated over derived activation bytes, bytes per logit, fixed overhead):
  bounded least squares on the relative error of the peak allocated memory of the launches that
  printed it, at the rank the model says peaks.
- Fit verdict (1 knob: allocatable bytes): the threshold on the predicted whole-run peak that
  classifies the most finished and out-of-memory launches right; the middle of the best interval.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from scipy.optimize import least_squares

from impl.common.api import ConfigError
from impl.common.hardware import HardwareProfile, MegatronKnobs

from .model import MegatronModel
from .runs import DocLengths, Launch, work_of
from .step import (F_ATTN, F_ELEM, F_GEMM, F_INTER, F_INTRA, F_ITER, F_LAYERS, M_ACT, M_LOGITS, M_ONE,
                   StepFeatures, features, iteration_times_s, phi_of, theta_of)
from .derive import step_knobs

TIME_KNOBS = (F_GEMM, F_ATTN, F_ELEM, F_INTRA, F_INTER, F_LAYERS, F_ITER)
# Scales the optimizer works in (seconds per unit at a plausible value), so every variable is O(1).
_SCALE = {F_GEMM: 1.0, F_ATTN: 1.0, F_ELEM: 1.0, F_INTRA: 1.0, F_INTER: 1.0, F_LAYERS: 1e-4, F_ITER: 0.1}
MIB = 2.0 ** 20
GIB = 2.0 ** 30


def knob_ranges(hw: HardwareProfile) -> dict:
    """The physical range of every fitted knob, ``name -> (low, high, why)``."""
    mem = hw.memory_bytes or 80 * GIB
    return {
        "gemm_time_factor": (0.8, 1.5, "Megatron's GEMMs over the table's cuBLAS GEMMs: the same kernels, plus the "
                             "weight gradient's accumulation into fp32 main grads"),
        "attn_time_factor": (0.8, 2.0, "Megatron's flash attention (attention dropout in the kernel, varlen) over "
                             "the table's kernel"),
        "elementwise_time_factor": (0.5, 4.0, "memory-bound kernels over their fused byte count (unfused "
                                    "kernels re-read their inputs)"),
        "intra_node_comm_efficiency": (0.3, 1.0, "NCCL's fraction of the NVLink datasheet rate per direction "
                                       "(a ring reaches ~0.8: github.com/NVIDIA/nccl-tests/issues/309, 369 of 450 GB/s on H100)"),
        "inter_node_comm_efficiency": (0.3, 1.0, "NCCL's fraction of the NIC's line rate (~0.94-0.96 on IB: SimAI "
                                       "calbusbw.h CX6_BW 23.5 of 25, CX7_BW 48.5 of 50 GB/s)"),
        "layer_overhead_s": (0.0, 2e-3, "host dispatch the GPU waits for, per layer and micro-batch: ~100 kernels "
                             "(forward + backward of the local transformer) x <= 20 us"),
        "iteration_overhead_s": (0.0, 2.0, "per iteration: optimizer host work, gradient norm, data loading, "
                                 "timers and logging synchronisations"),
        "activation_factor": (0.95, 1.35, "allocated over saved-tensor bytes: allocator block rounding, tensors "
                              "alive across backward transients"),
        "logits_bytes": (10.0, 16.0, "bytes per logit at the loss peak: the fork's bf16 logits (2), their fp32 "
                         "copy (4) and the max-shifted fp32 copy that becomes the softmax (4) are alive "
                         "together in the vocab-parallel cross-entropy's forward; above: allocator rounding"),
        "memory_overhead_bytes": (0.0, 4 * GIB, "workspaces and buffers besides states and activations"),
        "allocatable_bytes": (0.75 * mem, mem, "what PyTorch may allocate before an out-of-memory error"),
    }


_THETA_KNOB = {F_GEMM: "gemm_time_factor", F_ATTN: "attn_time_factor", F_ELEM: "elementwise_time_factor",
               F_INTRA: "intra_node_comm_efficiency", F_INTER: "inter_node_comm_efficiency",
               F_LAYERS: "layer_overhead_s", F_ITER: "iteration_overhead_s"}


def _theta_bounds(hw: HardwareProfile) -> tuple[np.ndarray, np.ndarray]:
    r = knob_ranges(hw)
    lo, hi = [], []
    for k in TIME_KNOBS:
        a, b, _ = r[_THETA_KNOB[k]]
        if k in (F_INTRA, F_INTER):  # theta = 1 / efficiency
            a, b = 1.0 / b, 1.0 / a
        lo.append(a / _SCALE[k])
        hi.append(b / _SCALE[k])
    return np.array(lo), np.array(hi)


def at_bound(knobs: MegatronKnobs, hw: HardwareProfile, rel: float = 1e-3) -> list[str]:
    """Knobs within ``rel`` of an end of their range (reported by the fit)."""
    out = []
    for name, (a, b, _) in knob_ranges(hw).items():
        v = getattr(knobs, name)
        span = max(b - a, 1e-30)
        if v <= a + rel * span or v >= b - rel * span:
            out.append(f"{name}={v:.4g} at {'low' if v <= a + rel * span else 'high'} bound [{a:.4g}, {b:.4g}]")
    return out


@dataclass
class Priced:
    """A launch with its features (None when its layout cannot run: ``error`` says why)."""

    launch: Launch
    feats: Optional[StepFeatures]
    error: str = ""


def featurize(launches: Sequence[Launch], hw: HardwareProfile, docs: Optional[DocLengths] = None) -> list[Priced]:
    docs = docs or DocLengths(launches)
    out = []
    for la in launches:
        if la.layout is None or la.model is None:
            continue
        if la.skip_reason:
            out.append(Priced(la, None, la.skip_reason))
            continue
        try:
            out.append(Priced(la, features(la.model, la.layout, hw, work_of(la, docs))))
        except ConfigError as e:
            out.append(Priced(la, None, str(e)))
    return out


def _theta_from(x: np.ndarray, base: np.ndarray) -> np.ndarray:
    th = base.copy()
    for i, k in enumerate(TIME_KNOBS):
        th[k] = x[i] * _SCALE[k]
    return th


def fit_time(priced: Sequence[Priced], theta0: np.ndarray, hw: Optional[HardwareProfile] = None) -> tuple[np.ndarray, dict]:
    rows = [p for p in priced if p.feats is not None and p.launch.measured_iteration_ms]
    if len(rows) < len(TIME_KNOBS):
        raise ConfigError(f"--runs: {len(rows)} timed launches cannot fit {len(TIME_KNOBS)} time knobs")
    meas = np.log(np.array([p.launch.measured_iteration_ms / 1e3 for p in rows]))

    def resid(x):
        th = _theta_from(x, theta0)
        pred = np.array([p.feats.iteration_s(th) for p in rows])
        return np.log(np.maximum(pred, 1e-9)) - meas

    x0 = np.array([theta0[k] / _SCALE[k] for k in TIME_KNOBS])
    if hw is not None:
        lo, hi = _theta_bounds(hw)
    else:
        lo, hi = np.array([1e-2, 1e-2, 1e-2, 1e-2, 1e-2, 0.0, 0.0]), np.full(len(x0), np.inf)
    x0 = np.clip(x0, lo + 1e-6 * (hi - lo if np.all(np.isfinite(hi)) else 1.0), None)
    x0 = np.minimum(x0, hi - 1e-6 * np.where(np.isfinite(hi), hi - lo, 0.0))
    sol = least_squares(resid, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1,
                        x_scale="jac", max_nfev=400)
    th = _theta_from(sol.x, theta0)
    r = resid(sol.x)
    return th, {"time_launches": len(rows), "time_log_residual_median_abs": round(float(np.median(np.abs(r))), 4)}


def _mem_rows(priced: Sequence[Priced]) -> list[Priced]:
    return [p for p in priced if p.feats is not None and p.launch.measured_peak_allocated_mb]


_MEM_COLS = (M_ACT, M_LOGITS, M_ONE)
_MEM_KNOBS = ("activation_factor", "logits_bytes", "memory_overhead_bytes")
_MEM_SCALE = np.array([1.0, 10.0, 2.0 * GIB])


def fit_memory(priced: Sequence[Priced], phi0: np.ndarray, hw: Optional[HardwareProfile] = None) -> tuple[np.ndarray, dict]:
    """Bounded soft-L1 least squares on the relative error of the peak (the max over ranks, as
    measured): a few launches whose data order put an unusually long window in flight do not pull
    every other launch."""
    rows = _mem_rows(priced)
    if len(rows) < 3:
        raise ConfigError(f"--runs: {len(rows)} launches with a printed peak cannot fit 3 memory knobs")
    meas = np.array([p.launch.measured_peak_allocated_mb * MIB for p in rows])
    Ms = np.stack([_pad_stages(printed(p), 64) for p in rows])  # (n, stages, N_MEM)
    cols = list(_MEM_COLS)

    def phi_at(x):
        phi = phi0.copy()
        phi[cols] = x * _MEM_SCALE
        return phi

    def resid(x):
        return (Ms @ phi_at(x)).max(axis=1) / meas - 1.0

    r = knob_ranges(hw) if hw is not None else None
    if r:
        lo = np.array([r[k][0] for k in _MEM_KNOBS]) / _MEM_SCALE
        hi = np.array([r[k][1] for k in _MEM_KNOBS]) / _MEM_SCALE
    else:
        lo, hi = np.zeros(3), np.full(3, np.inf)
    x0 = np.clip(phi0[cols] / _MEM_SCALE, lo + 1e-6, np.where(np.isfinite(hi), hi - 1e-6, np.inf))
    sol = least_squares(resid, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.05, x_scale="jac")
    rel = np.abs(resid(sol.x))
    return phi_at(sol.x), {"memory_launches": len(rows), "memory_rel_error_median": round(float(np.median(rel)), 4)}


def printed(p: Priced) -> np.ndarray:
    """Memory features of the stages whose peak the launch printed (what its measured max covers)."""
    st = [s for s in p.launch.printed_stages if s < p.feats.M_report.shape[0]]
    return p.feats.M_report[st] if st else p.feats.M_report


def _pad_stages(M: np.ndarray, n: int) -> np.ndarray:
    """Stack launches of different pp: extra all-zero stages never win the max (states > 0)."""
    out = np.zeros((n, M.shape[1]))
    out[:M.shape[0]] = M
    return out


def fit_allocatable(priced: Sequence[Priced], phi: np.ndarray, capacity: float,
                    floor: float = 0.0) -> tuple[float, dict]:
    rows = [p for p in priced if p.feats is not None and p.launch.measured_fits is not None]
    if not rows:
        return capacity, {"verdict_launches": 0}
    peak = np.array([float(p.feats.memory_bytes(phi, run=True).max()) for p in rows])
    fits = np.array([bool(p.launch.measured_fits) for p in rows])
    # right(A) = fitting launches with peak <= A + OOM launches with peak > A
    order = np.argsort(peak)
    best, best_lo, best_hi = -1, 0.0, capacity
    srt_peak, srt_fit = peak[order], fits[order]
    fit_le = np.cumsum(srt_fit)
    oom_total = int((~fits).sum())
    oom_le = np.cumsum(~srt_fit)
    for i, a in enumerate(srt_peak):
        if a > capacity:
            break
        if a < floor:
            continue
        right = int(fit_le[i]) + oom_total - int(oom_le[i])
        nxt = min(srt_peak[i + 1] if i + 1 < len(srt_peak) else capacity, capacity)
        if right > best:
            best, best_lo, best_hi = right, a, nxt
    allocatable = max(floor, 0.5 * (best_lo + best_hi)) if best >= 0 else capacity
    return float(allocatable), {"verdict_launches": len(rows), "verdict_right_in_fit": round(best / len(rows), 4)}


def knobs_from(theta: np.ndarray, phi: np.ndarray, allocatable: float, hw: HardwareProfile,
               model: Optional[MegatronModel] = None) -> MegatronKnobs:
    return MegatronKnobs(
        gemm_time_factor=float(theta[F_GEMM]), attn_time_factor=float(theta[F_ATTN]),
        elementwise_time_factor=float(theta[F_ELEM]),
        intra_node_comm_efficiency=float(1.0 / theta[F_INTRA]),
        inter_node_comm_efficiency=float(1.0 / theta[F_INTER]),
        layer_overhead_s=float(theta[F_LAYERS]), iteration_overhead_s=float(theta[F_ITER]),
        activation_factor=float(phi[M_ACT]), logits_bytes=float(phi[M_LOGITS]), memory_overhead_bytes=float(phi[M_ONE]),
        allocatable_bytes=float(allocatable))


def fit(priced: Sequence[Priced], hw: HardwareProfile) -> tuple[MegatronKnobs, dict]:
    """Every knob from ``priced`` (features computed on ``hw``), the fit's residuals and the knobs
    at a bound of their range."""
    k0 = step_knobs(hw)
    theta, tinfo = fit_time(priced, theta_of(hw, k0), hw)
    phi, minfo = fit_memory(priced, phi_of(k0), hw)
    lo_alloc = knob_ranges(hw)["allocatable_bytes"][0]
    alloc, vinfo = fit_allocatable(priced, phi, hw.memory_bytes, lo_alloc)
    model = next((p.launch.model for p in priced if p.launch.model is not None), None)
    knobs = knobs_from(theta, phi, alloc, hw, model)
    return knobs, {**tinfo, **minfo, **vinfo, "at_bound": at_bound(knobs, hw)}


# ---- predictions ---------------------------------------------------------------------------

def predict(p: Priced, hw: HardwareProfile, knobs: Optional[MegatronKnobs] = None) -> dict:
    """One predictions.jsonl line: the prediction and the measured values beside it."""
    la = p.launch
    row = {"id": la.id, "status": la.status, "mode": la.layout.mode, "arch": la.model.arch, "model": la.model.name,
           "gpus": la.layout.gpus, "context": la.layout.context, "dp": la.layout.dp, "tp": la.layout.tp,
           "pp": la.layout.pp, "mbs": la.layout.mbs,
           "measured_fits": la.measured_fits, "measured_iteration_ms": la.measured_iteration_ms,
           "measured_peak_allocated_mb": la.measured_peak_allocated_mb}
    if p.feats is None:
        return {**row, "predicted_fits": False, "predicted_peak_allocated_mb": None, "predicted_iteration_ms": None,
                "predicted_peak_allocated_mb_printed_ranks": None,
                "predicted_error": p.error}
    k = knobs or step_knobs(hw)
    theta, phi = theta_of(hw, k), phi_of(k)
    peak = float(p.feats.memory_bytes(phi).max())
    peak_printed = float((printed(p) @ phi).max())
    run_peak = float(p.feats.memory_bytes(phi, run=True).max())
    fits = run_peak <= (k.allocatable_bytes or hw.memory_bytes)
    it = float(np.mean(iteration_times_s(p.feats.T, p.feats.G, theta)))
    return {**row, "predicted_fits": bool(fits), "predicted_peak_allocated_mb": round(peak / MIB, 1),
            "predicted_peak_allocated_mb_printed_ranks": round(peak_printed / MIB, 1),
            "printed_stages": list(la.printed_stages),
            "predicted_iteration_ms": round(it * 1e3, 2) if fits else None,
            "predicted_iteration_ms_if_run": round(it * 1e3, 2)}


def folds_of(priced: Sequence[Priced], k: int, seed: int = 0) -> list[int]:
    """Fold of each launch: a seeded permutation of the file's order, dealt round-robin."""
    perm = np.random.default_rng(seed).permutation(len(priced))
    fold = [0] * len(priced)
    for rank, i in enumerate(perm):
        fold[i] = rank % k
    return fold


def cross_validate(priced: Sequence[Priced], hw: HardwareProfile, k: int, seed: int = 0,
                   progress=None) -> tuple[list[dict], list[dict]]:
    """Held-out predictions of every launch (fit on the other k-1 folds) and each fold's knobs."""
    if k < 2:
        raise ConfigError(f"--folds: needs >= 2 folds, got {k}")
    fold = folds_of(priced, k, seed)
    preds: list[Optional[dict]] = [None] * len(priced)
    per_fold = []
    for f in range(k):
        train = [p for p, g in zip(priced, fold) if g != f]
        knobs, info = fit(train, hw)
        per_fold.append({"fold": f, "knobs": dataclasses.asdict(knobs), **info})
        for i, (p, g) in enumerate(zip(priced, fold)):
            if g == f:
                preds[i] = {**predict(p, hw, knobs), "fold": f}
        if progress:
            progress(f)
    return [x for x in preds if x is not None], per_fold


# ---- the error table ---------------------------------------------------------------------

def error_table(preds: Sequence[dict]) -> dict:
    """Median and 90th-percentile |error| of pad time, pack time and memory (and the median signed
    error: below 0 the model under-prices); verdict accuracy."""
    out = {}
    for mode in ("pad", "pack"):
        e = [r["predicted_iteration_ms_if_run"] / r["measured_iteration_ms"] - 1 for r in preds
             if r["mode"] == mode and r.get("measured_iteration_ms") and r.get("predicted_iteration_ms_if_run")]
        out[f"{mode}_time"] = _summary(e)
    # The measured peak covers the ranks the log printed (some logs kept one node's prints only).
    e = [r["predicted_peak_allocated_mb_printed_ranks"] / r["measured_peak_allocated_mb"] - 1 for r in preds
         if r.get("measured_peak_allocated_mb") and r.get("predicted_peak_allocated_mb_printed_ranks")]
    out["memory"] = _summary(e)
    v = [r for r in preds if r.get("measured_fits") is not None]
    right = sum(bool(r["predicted_fits"]) == bool(r["measured_fits"]) for r in v)
    conf = {"fits_predicted_fits": sum(bool(r["measured_fits"]) and bool(r["predicted_fits"]) for r in v),
            "fits_predicted_oom": sum(bool(r["measured_fits"]) and not r["predicted_fits"] for r in v),
            "oom_predicted_fits": sum((not r["measured_fits"]) and bool(r["predicted_fits"]) for r in v),
            "oom_predicted_oom": sum((not r["measured_fits"]) and not r["predicted_fits"] for r in v)}
    out["verdict"] = {"n": len(v), "right": right, "accuracy": round(right / len(v), 4) if v else math.nan, **conf}
    return out


def _summary(e: Sequence[float]) -> dict:
    """Of signed relative errors (predicted / measured - 1)."""
    if not e:
        return {"n": 0, "median_abs": math.nan, "p90_abs": math.nan, "median_signed": math.nan}
    s = np.asarray(e)
    a = np.abs(s)
    return {"n": int(a.size), "median_abs": round(float(np.median(a)), 4), "p90_abs": round(float(np.percentile(a, 90)), 4),
            "median_signed": round(float(np.median(s)), 4)}
