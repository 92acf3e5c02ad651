"""Sim mode: FISEdit at paper scale (SD 2.1, 768^2 -> latent 96^2, CFG batch 2, 50 steps) over
the per-op roofline cost model (`impl/fisedit/README.md`, "Reconstructed choices": Sim).
Deterministic: no randomness beyond seeded
generators, no timing.

Step times
- diffusers dense step: sum of roofline op times (``impl.common.diffusion.cost``);
- dense-engine step: diffusers step / ``engine_gain`` (the authors' Hetu fused kernels, [R] 1.3-1.6x);
- sparse step: the sparse op times (``cost.step_cost``, real per-layer masks; of the
  paper's fused engine, or with ``system.sim_engine=reference`` of this repo's engine), divided by
  ``engine_gain`` only when the engine's gains are included, plus the cache's H2D over PCIe
  (datasheet x ``pcie_efficiency``) beyond what compute hides.
The end-to-end figures count UNet steps (k dense + N-k sparse, either order) plus a mask-capture
cost for the online schedule; text encoding and VAE decoding are left out of every system
alike.

Scenarios: F1 speedup vs f (both schedules), F2 dataset average over Beta-distributed mask
ratios, F3 host-RAM budget sweep (GPU / host / recompute), F4 multi-user server whose host RAM
caps how many sessions keep a cache (pinned sessions hit, the others fall back to dense).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from impl.common.api import ConfigError, JobContext, Metric, RunResult
from impl.common.diffusion.cost import BYTES, dense_step_time_s, forward_torch_calls, trace_unet_glue, trace_unet_ops
from impl.common.diffusion.pipelines import SD21_ATTENTION_HEAD_DIM, SD21_UNET
from impl.common.plots.save import save_png
from impl.common.registry import Registry

from impl.fisedit.cost import Thresholds, cache_bytes_per_step, step_cost
from impl.fisedit.mask import synthetic_mask
from impl.fisedit.schedules import EDIT_SCHEDULES

SCENARIOS = ("f1", "f2", "f3", "f4")
PAPER_BAND = (3.0, 4.5)
F_BUCKET = 0.005  # F2 memoises step costs per mask-ratio bucket


@dataclass
class Model:
    ops: list
    th: Thresholds
    latent_hw: tuple
    hw: object
    dtype: str
    block: int
    gain: float
    pcie_eff: float
    launch_s: float
    step_bytes: float
    N: int
    k: int
    dense_diff_s: float
    fallback: float
    cache_dtype: str = "fp16"
    engine: str = "fused"  # cost.SIM_ENGINES
    torch_calls: int = 0  # the dense forward's torch calls, charged at hw.host_dispatch_s (CPU profiles)
    glue: tuple = ()  # the forward's non-module ops, priced on profiles with glue rates (CPU profiles)
    memo: dict = field(default_factory=dict)

    @property
    def dense_engine_s(self) -> float:
        return self.dense_diff_s / self.gain

    def sparse_step_s(self, f: float, *, with_gain: bool, on_gpu: bool = False) -> float:
        return _sparse_step(self, round(f / F_BUCKET) * F_BUCKET if f > 0 else 0.0, with_gain, on_gpu)

    on_gpu_default: bool = True

    def edit_s(self, f: float, *, with_gain: bool = True, schedule: str = "supplied", cached_steps=None,
               on_gpu=None) -> float:
        """One edit, UNet steps only. ``cached_steps``: sparse steps whose cache is present
        (the rest recompute densely)."""
        dense = self.dense_engine_s if with_gain else self.dense_diff_s
        on_gpu = self.on_gpu_default if on_gpu is None else on_gpu
        if f > self.fallback:
            return self.N * dense
        n_sparse = self.N - self.k
        hit = n_sparse if cached_steps is None else max(0, min(n_sparse, cached_steps))
        t = (self.N - hit) * dense + hit * self.sparse_step_s(f, with_gain=with_gain, on_gpu=on_gpu)
        return t + EDIT_SCHEDULES.get(schedule).mask_capture_s


def _sparse_step(m: Model, f: float, with_gain: bool, on_gpu: bool) -> float:
    key = (f, with_gain, on_gpu)
    if key not in m.memo:
        mask = synthetic_mask(m.latent_hw, min(1.0, f), "rect", seed=0)
        sc = step_cost(m.ops, mask, m.th, m.latent_hw, m.block, m.hw, m.dtype, m.launch_s,
                       cache_bytes=0.0, pcie_efficiency=m.pcie_eff, cache_on_gpu=True, engine=m.engine,
                       torch_calls=m.torch_calls, glue=m.glue)
        compute = sc.sparse_compute_s / (m.gain if with_gain else 1.0)
        h2d = 0.0 if on_gpu else m.step_bytes / (m.hw.host_link_bw_bytes_per_s * m.pcie_eff)
        m.memo[key] = compute + max(0.0, h2d - compute)
    return m.memo[key]


def build_model(system, job: JobContext) -> Model:
    cfg, wl = system.cfg, job.workload
    sp = wl.sim
    hw = job.hardware
    if sp.scenario not in SCENARIOS:
        raise ConfigError(f"workload.sim.scenario: unknown value {sp.scenario!r} (one of: {', '.join(SCENARIOS)})")
    if sp.dtype not in hw.peak_flops:
        raise ConfigError(f"workload.sim.dtype: hardware {hw.name} has no peak_flops for {sp.dtype!r}")
    if not 0 < sp.mask_steps < sp.num_steps:
        raise ConfigError(f"workload.sim.mask_steps {sp.mask_steps} must be in [1, {sp.num_steps - 1}]")
    if sp.unet == "sd21":
        shape, heads = SD21_UNET, SD21_ATTENTION_HEAD_DIM
    elif sp.unet == "workload":
        shape, heads = wl.unet, None
    else:
        raise ConfigError(f"workload.sim.unet: unknown value {sp.unet!r} (one of: sd21, workload)")
    ops = trace_unet_ops(shape, batch=sp.batch, attention_head_dim=heads)
    latent_hw = (shape.sample_size, shape.sample_size)
    auto = Thresholds.auto(latent_hw)
    th = Thresholds(cfg.conv_min_cells or auto.conv_min, cfg.linear_min_cells or auto.linear_min,
                    cfg.attn_min_cells or auto.attn_min)
    cache_dtype = sp.dtype if cfg.cache_dtype == "auto" else cfg.cache_dtype
    if cache_dtype not in BYTES:
        raise ConfigError(f"system.cache_dtype: unknown value {cache_dtype!r} (one of: auto, {', '.join(BYTES)})")
    step_bytes = cache_bytes_per_step(ops, th, cache_dtype, latent_elems=shape.in_channels * latent_hw[0] * latent_hw[1])
    # a CPU profile charges host dispatch per torch call; the count needs one meta-device forward
    calls = forward_torch_calls(shape, batch=sp.batch, attention_head_dim=heads) if hw.diffusion.host_dispatch_s else 0
    # a profile with glue rates prices the forward's non-module ops; tracing them needs one more
    glue = trace_unet_glue(shape, batch=sp.batch, attention_head_dim=heads) if hw.glue_bw("elementwise", sp.dtype) else []
    dense = dense_step_time_s(ops, hw, sp.dtype, sp.launch_overhead_s, torch_calls=calls, glue=glue)
    return Model(ops, th, latent_hw, hw, sp.dtype, cfg.block, sp.engine_gain, cfg.pcie_efficiency,
                 sp.launch_overhead_s, step_bytes, sp.num_steps, sp.mask_steps, dense, cfg.dense_fallback_ratio,
                 cache_dtype=cache_dtype, on_gpu_default=cfg.cache_on_gpu, engine=cfg.sim_engine, torch_calls=calls,
                 glue=tuple(glue))


def beta_params(mean: float, p90: float) -> tuple:
    from scipy.optimize import brentq
    from scipy.stats import beta

    if not 0 < mean < p90 < 1:
        raise ConfigError(f"workload.sim: need 0 < mask_mean ({mean}) < mask_p90 ({p90}) < 1")
    g = lambda a: beta.ppf(0.9, a, a * (1 - mean) / mean) - p90  # noqa: E731
    a = brentq(g, 1e-3, 1e3)
    return a, a * (1 - mean) / mean


def mask_ratios(sp, seed: int) -> np.ndarray:
    a, b = beta_params(sp.mask_mean, sp.mask_p90)
    rng = np.random.default_rng(seed)
    return rng.beta(a, b, size=sp.n_edits)



# The dense baselines' step time from the built model: every step dense, through diffusers or
# through this repo's engine. FISEdit itself (None) prices its sparse edit.
DENSE_STEP: Registry = Registry("value", "system.variant")
DENSE_STEP.add("fisedit", None)
DENSE_STEP.add("diffusers_dense", lambda m: m.dense_diff_s)
DENSE_STEP.add("dense_edit", lambda m: m.dense_engine_s)


def run_sim(system, job: JobContext) -> RunResult:
    cfg, wl = system.cfg, job.workload
    sp = wl.sim
    m = build_model(system, job)
    metrics: dict = {}
    info: dict = {"scenario": sp.scenario, "hardware": m.hw.name, "dtype": sp.dtype, "num_steps": m.N,
                  "mask_steps": m.k, "engine_gain": m.gain, "thresholds_cells": vars(m.th),
                  "cache_bytes_per_step": m.step_bytes, "cache_dtype": m.cache_dtype, "dense_step_diffusers_s": m.dense_diff_s,
                  "dense_step_engine_s": m.dense_engine_s, "n_ops": len(m.ops), "sim_engine": m.engine,
                  "torch_calls_dense_step": m.torch_calls}
    ref_f = sp.mask_mean
    # every variant reports its own per-edit time at the representative f (for compare tables)
    dense_step = DENSE_STEP.get(cfg.variant)
    if dense_step is not None:
        step_s = dense_step(m)
        metrics["e2e_time_s"] = Metric.scalar(m.N * step_s, "s", "lower")
        metrics["step_time_s"] = Metric.scalar(step_s, "s", "lower")
        return RunResult(metrics=metrics, info=info)
    wg = cfg.include_engine_gain
    metrics["e2e_time_s"] = Metric.scalar(m.edit_s(ref_f, with_gain=wg, schedule=cfg.schedule), "s", "lower")
    metrics["engine_gain_included"] = Metric.scalar(1.0 if wg else 0.0, "bool", "higher")
    metrics["sparse_step_speedup"] = Metric.scalar(
        m.dense_engine_s / m.sparse_step_s(ref_f, with_gain=True, on_gpu=m.on_gpu_default), "x", "higher")
    info["cache_placement"] = "gpu/H2D hidden" if m.on_gpu_default else f"host over PCIe ({m.cache_dtype})"
    res = RunResult(metrics=metrics, info=info)
    {"f1": _f1, "f2": _f2, "f3": _f3, "f4": _f4}[sp.scenario](m, system, job, res)
    return res


def _cap(N, k, f):
    return N / (k + (N - k) * f)


def _f1(m: Model, system, job, res: RunResult):
    sp = job.workload.sim
    rows = []
    for f in sp.f_grid:
        row = {"f": f, "cap_spec": _cap(m.N, m.k, f)}
        for sched in ("online", "supplied"):
            t_g = m.edit_s(f, with_gain=True, schedule=sched)
            t_n = m.edit_s(f, with_gain=False, schedule=sched)
            row[f"{sched}_vs_dense_engine"] = m.N * m.dense_engine_s / t_g
            row[f"{sched}_vs_diffusers_with_gain"] = m.N * m.dense_diff_s / t_g
            row[f"{sched}_vs_diffusers_no_gain"] = m.N * m.dense_diff_s / t_n
        row["sparse_step_speedup"] = m.dense_engine_s / m.sparse_step_s(f, with_gain=True, on_gpu=m.on_gpu_default)
        row["supplied_vs_diffusers_host_cache"] = m.N * m.dense_diff_s / m.edit_s(f, with_gain=True, on_gpu=False)
        rows.append(row)
        tag = f"f{f:.2f}"
        res.metrics[f"speedup_vs_dense_engine_{tag}"] = Metric.scalar(row["supplied_vs_dense_engine"], "x", "higher")
        res.metrics[f"speedup_vs_diffusers_{tag}"] = Metric.scalar(row["supplied_vs_diffusers_with_gain"], "x", "higher")
        res.metrics[f"cap_{tag}"] = Metric.scalar(row["cap_spec"], "x", "higher")
    res.info["f1"] = [{k: round(v, 4) for k, v in r.items()} for r in rows]
    res.artifacts.append(_plot_f1(rows, job, m))


def _f2(m: Model, system, job, res: RunResult):
    sp = job.workload.sim
    fs = mask_ratios(sp, job.seed)
    t_diff = m.N * m.dense_diff_s
    t_eng = m.N * m.dense_engine_s
    tg = np.array([m.edit_s(float(f), with_gain=True, schedule=system.cfg.schedule) for f in fs])
    tn = np.array([m.edit_s(float(f), with_gain=False, schedule=system.cfg.schedule) for f in fs])
    with_gain = len(fs) * t_diff / tg.sum()
    no_gain = len(fs) * t_diff / tn.sum()
    vs_eng = len(fs) * t_eng / tg.sum()
    fallback = float((fs > m.fallback).mean())
    r = res.metrics
    r["f2_speedup_vs_diffusers_with_engine_gain"] = Metric.scalar(with_gain, "x", "higher")
    r["f2_speedup_vs_diffusers_no_engine_gain"] = Metric.scalar(no_gain, "x", "higher")
    r["f2_speedup_vs_dense_engine"] = Metric.scalar(vs_eng, "x", "higher")
    r["f2_mean_per_edit_speedup_vs_diffusers"] = Metric.scalar(float(np.mean(t_diff / tg)), "x", "higher")
    r["f2_in_paper_band_with_gain"] = Metric.scalar(float(PAPER_BAND[0] <= with_gain <= PAPER_BAND[1]), "bool", "higher")
    r["f2_in_paper_band_no_gain"] = Metric.scalar(float(PAPER_BAND[0] <= no_gain <= PAPER_BAND[1]), "bool", "higher")
    th_ = np.array([m.edit_s(float(f), with_gain=True, on_gpu=False) for f in fs])
    r["f2_speedup_vs_diffusers_host_cache_pcie"] = Metric.scalar(len(fs) * t_diff / th_.sum(), "x", "higher")
    r["f2_dense_fallback_fraction"] = Metric.scalar(fallback, "fraction", "lower")
    r["e2e_speedup_vs_diffusers_dense"] = Metric.scalar(with_gain if system.cfg.include_engine_gain else no_gain, "x", "higher")
    r["e2e_speedup_vs_dense_edit"] = Metric.scalar(vs_eng, "x", "higher")
    res.info["f2"] = {"beta_a_b": [round(x, 4) for x in beta_params(sp.mask_mean, sp.mask_p90)],
                      "mask_ratio_mean": float(fs.mean()), "mask_ratio_p90": float(np.quantile(fs, 0.9)),
                      "headline_includes_engine_gain": bool(system.cfg.include_engine_gain),
                      "paper_band": list(PAPER_BAND),
                      "note": "the band is reached only with the dense-engine gain included"
                      if (PAPER_BAND[0] <= with_gain and not PAPER_BAND[0] <= no_gain <= PAPER_BAND[1])
                      else "see both figures"}
    res.artifacts.append(_plot_f2(fs, t_diff / tg, t_diff / tn, job, m))


def _gpu_spare_bytes(m: Model) -> float:
    # Weights of the UNet actually modelled (SD 2.1 or the workload's), from its traced ops.
    weights = sum(op.weight_elems for op in m.ops) * BYTES[m.dtype]
    act = 4e9  # [R] activations + workspace of a CFG-2 768^2 step, fp16
    return max(0.0, m.hw.memory_bytes - weights - act)


def _f3(m: Model, system, job, res: RunResult):
    sp = job.workload.sim
    f = sp.mask_mean
    n_sparse = m.N - m.k
    image_bytes = n_sparse * m.step_bytes
    t_eng = m.N * m.dense_engine_s
    rows = []
    for budget in sp.host_budgets_bytes:
        steps = int(budget // m.step_bytes) if m.step_bytes else n_sparse
        t = m.edit_s(f, cached_steps=steps, on_gpu=False)
        rows.append({"host_budget_bytes": budget, "cached_steps": min(steps, n_sparse), "speedup": t_eng / t})
        res.metrics[f"speedup_host_{budget / 1e9:g}GB"] = Metric.scalar(t_eng / t, "x", "higher")
    gpu_steps = int(_gpu_spare_bytes(m) // m.step_bytes)
    t_gpu = m.edit_s(f, cached_steps=gpu_steps, on_gpu=True)
    res.metrics["speedup_gpu_resident"] = Metric.scalar(t_eng / t_gpu, "x", "higher")
    # No cache at all: every sparse-phase step recomputes densely (the F3 "recompute" arm).
    res.metrics["speedup_recompute"] = Metric.scalar(t_eng / m.edit_s(f, cached_steps=0, on_gpu=False), "x", "higher")
    res.metrics["cache_bytes_per_image"] = Metric.scalar(image_bytes, "bytes", "lower")
    res.metrics["cache_bytes_per_step"] = Metric.scalar(m.step_bytes, "bytes", "lower")
    res.metrics["h2d_s_per_step"] = Metric.scalar(m.step_bytes / (m.hw.host_link_bw_bytes_per_s * m.pcie_eff), "s", "lower")
    res.info["f3"] = {"rows": rows, "gpu_resident_steps": min(gpu_steps, n_sparse), "f": f}
    res.artifacts.append(_plot_f3(rows, t_eng / t_gpu, job, m))


def _f4(m: Model, system, job, res: RunResult):
    sp = job.workload.sim
    f = sp.mask_mean
    n_sparse = m.N - m.k
    image_bytes = n_sparse * m.step_bytes
    capacity = int(sp.server_host_ram_bytes // image_bytes) if image_bytes else 10 ** 9
    t_hit = m.edit_s(f, on_gpu=False)  # the server's caches live in host RAM
    t_miss = m.N * m.dense_engine_s
    record = m.N * m.dense_engine_s  # original generation; its D2H overlaps compute
    rows = []
    for u in sp.users:
        hit = min(1.0, capacity / u)
        edit = hit * t_hit + (1 - hit) * t_miss
        session = record + sp.rounds * edit
        dense_session = record + sp.rounds * t_miss
        rows.append({"users": u, "hit_rate": hit, "edit_s": edit, "session_speedup": dense_session / session,
                     "edits_per_s": sp.rounds * u / (u * session)})
        res.metrics[f"edit_speedup_users{u}"] = Metric.scalar(t_miss / edit, "x", "higher")
        res.metrics[f"hit_rate_users{u}"] = Metric.scalar(hit, "fraction", "higher")
    res.metrics["cached_sessions_capacity"] = Metric.scalar(capacity, "sessions", "higher")
    res.info["f4"] = {"rows": [{k: round(v, 5) for k, v in r.items()} for r in rows], "f": f,
                      "policy": "pinned: the first `capacity` sessions keep their cache, the rest run dense",
                      "server_host_ram_bytes": sp.server_host_ram_bytes, "image_cache_bytes": image_bytes}
    res.artifacts.append(_plot_f4(rows, capacity, job, m))


# ---- plots -------------------------------------------------------------------------------
def _fig():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_f1(rows, job, m):
    plt = _fig()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    fs = [r["f"] for r in rows]
    ax.plot(fs, [r["supplied_vs_dense_engine"] for r in rows], "o-", label="vs dense engine (supplied)")
    ax.plot(fs, [r["online_vs_dense_engine"] for r in rows], "x--", label="vs dense engine (online)")
    ax.plot(fs, [r["supplied_vs_diffusers_with_gain"] for r in rows], "s-", label="vs diffusers, engine gain incl.")
    ax.plot(fs, [r["supplied_vs_diffusers_no_gain"] for r in rows], "^-", label="vs diffusers, no engine gain")
    ax.plot(fs, [r["supplied_vs_diffusers_host_cache"] for r in rows], "v-.", label="vs diffusers, host cache over PCIe")
    ax.plot(fs, [r["cap_spec"] for r in rows], "k:", label="cap N/(k+(N-k)f)")
    ax.set_xlabel("mask ratio f")
    ax.set_ylabel("end-to-end speedup (x)")
    ax.set_title(f"FISEdit F1 (sim) on {m.hw.name}, SD2.1 768, {m.N} steps, k={m.k}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    p = save_png(fig, job.out_dir / "f1_speedup_vs_f.png")
    return p.name


def _plot_f2(fs, with_gain, no_gain, job, m):
    plt = _fig()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.hist(with_gain, bins=40, alpha=0.6, label="vs diffusers, engine gain incl.")
    ax.hist(no_gain, bins=40, alpha=0.6, label="vs diffusers, no engine gain")
    ax.axvspan(*PAPER_BAND, color="g", alpha=0.1, label="paper band 3-4.5x")
    ax.set_xlabel("per-edit end-to-end speedup (x)")
    ax.set_ylabel("edits")
    ax.set_title(f"FISEdit F2 (sim) on {m.hw.name}: {len(fs)} edits, f ~ Beta")
    ax.legend(fontsize=8)
    p = save_png(fig, job.out_dir / "f2_dataset_speedup.png")
    return p.name


def _plot_f3(rows, gpu_speedup, job, m):
    plt = _fig()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot([r["host_budget_bytes"] / 1e9 for r in rows], [r["speedup"] for r in rows], "o-", label="cache in host RAM")
    ax.axhline(gpu_speedup, color="C1", ls="--", label="cache in spare GPU memory")
    ax.axhline(1.0, color="k", ls=":", label="recompute (no cache)")
    ax.set_xlabel("host RAM budget per image (GB)")
    ax.set_ylabel("speedup vs dense engine (x)")
    ax.set_title(f"FISEdit F3 (sim) on {m.hw.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    p = save_png(fig, job.out_dir / "f3_ram_budget.png")
    return p.name


def _plot_f4(rows, capacity, job, m):
    plt = _fig()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    us = [r["users"] for r in rows]
    ax.plot(us, [r["session_speedup"] for r in rows], "o-", label="session speedup vs dense")
    ax.plot(us, [r["hit_rate"] for r in rows], "s--", label="cache hit rate")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent users")
    ax.set_title(f"FISEdit F4 (sim) on {m.hw.name}: capacity {capacity} cached sessions")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    p = save_png(fig, job.out_dir / "f4_multi_user.png")
    return p.name
