"""Real mode of FISEdit / dense_edit / diffusers_dense (random weights, measured)."""
from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time

import torch

from impl.common.api import JobContext, Metric, RunResult
from impl.common.diffusion.cost import trace_unet_ops
from impl.common.diffusion.pipelines import build_components, build_scheduler, sd_pipeline
from impl.common.diffusion.quality import psnr, ssim
from impl.common.host_alloc import host_malloc_in_force
from impl.common.registry import Registry

from impl.fisedit.cost import Thresholds, step_cost
from impl.fisedit.sparse_modules import CachedConv2d, uninstall, install, wrappers
from impl.fisedit.mask import check_mask, synthetic_mask
from impl.fisedit.pipeline import FISEditPipeline
from impl.fisedit.schedules import EDIT_SCHEDULES

log = logging.getLogger("impl.fisedit")


def setup(system, job: JobContext):
    wl, cfg = job.workload, system.cfg
    job.execution.apply_threads(wl.torch_threads)
    device = job.execution.torch_device()
    dtype = job.execution.torch_dtype(wl.dtype)
    comps = build_components(wl.unet, job.seed, wl.scheduler, device=str(device), dtype=dtype)
    pipe = FISEditPipeline(comps, guidance_scale=wl.guidance_scale, block=cfg.block, exact=not cfg.approx_groupnorm,
                           radical_attn=cfg.radical_attn, conv_min_cells=cfg.conv_min_cells,
                           linear_min_cells=cfg.linear_min_cells, attn_min_cells=cfg.attn_min_cells,
                           progress=job.show_progress, engine=cfg.engine, cache_device=cfg.cache_device,
                           cuda_graph=cfg.cuda_graph, dense_tile_fraction=cfg.dense_tile_fraction)
    return pipe, device, dtype


def make_mask(job, pipe, ratio):
    wl = job.workload
    hw = tuple(wl.mask_hw) if wl.mask_hw else pipe.latent_hw
    m = synthetic_mask(hw, ratio, wl.mask_shape, seed=job.seed)
    return check_mask(m, pipe.latent_hw)


@contextlib.contextmanager
def stock_unet(pipe):
    """The stock diffusers UNet for the diffusers_dense reference: wrappers taken out."""
    state = pipe.state
    pipe.graphed.drop()  # graphs of the wrapped tree must not outlive it
    uninstall(pipe.c.unet)
    try:
        yield
    finally:
        install(pipe.c.unet, state)


def diffusers_graph(pipe):
    """The stock pipeline's UNet calls replayed from a CUDA graph when the job graphs its steps
    (``system.cuda_graph``), so the diffusers baseline runs in the same launch regime."""
    if not pipe.graph_on:
        return contextlib.nullcontext()
    if getattr(pipe, "_diffusers_graphed", None) is None:
        from impl.fisedit.graphs import GraphedUNet

        pipe._diffusers_graphed = GraphedUNet(pipe.c.unet, lambda: ("diffusers", ()))
    return pipe._diffusers_graphed.active()


def launch_info(pipe) -> dict:
    """Which launch regime every timed UNet call of this job ran in (ratios compare like with like)."""
    info = {"launch_regime": "cuda_graph" if pipe.graph_on else "eager", "engine": pipe.state.engine,
            "cache_device": str(pipe.cache_store_device() or "host")}
    if pipe.graph_on:
        info["graphs"] = pipe.graphed.stats()
        dg = getattr(pipe, "_diffusers_graphed", None)
        if dg is not None:
            info["graphs_diffusers"] = dg.stats()
    return info


def diffusers_dense_run(pipe, job, prompt) -> float:
    wl = job.workload
    sd = sd_pipeline(pipe.c, "text2img")
    z = pipe.initial_latent(job.seed)
    h, w = pipe.latent_hw
    scale = sd.vae_scale_factor
    with stock_unet(pipe), diffusers_graph(pipe):
        pipe._sync()
        t0 = time.perf_counter()
        sd(prompt=prompt, negative_prompt="", num_inference_steps=wl.num_steps, guidance_scale=wl.guidance_scale,
           height=h * scale, width=w * scale, latents=z.clone(), output_type="pt")
        pipe._sync()
        return time.perf_counter() - t0


def step_pair_times(pipe, orig, emb, mask, step_idx, repeats):
    """Interleaved (dense, sparse) UNet-call pairs at one step of the sparse phase."""
    st = pipe.state
    sched = pipe.fresh_scheduler(len(orig.latents))
    t = sched.timesteps[step_idx]
    z = orig.latents[step_idx - 1] if step_idx > 0 else orig.cache.meta["z_T"].to(orig.latent)
    dense, sparse = [], []

    def call(sparse_mode: bool):
        st.mode = "edit" if sparse_mode else "off"
        st.sparse, st.step = sparse_mode, step_idx
        st.set_cache(orig.cache)
        pipe._sync()
        t0 = time.perf_counter()
        pipe.unet_eps(z, t, emb, sched)
        pipe._sync()
        return time.perf_counter() - t0

    st.set_mask(mask)
    pipe._prepare_cache(orig.cache)
    try:
        call(True)
        call(False)  # warm-up both paths
        for r in range(repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            for sp in order:
                (sparse if sp else dense).append(call(sp))
    finally:
        st.mode, st.sparse, st.cache = "off", False, None
    return dense, sparse


def layer_profile(pipe, orig, emb, mask, step_idx):
    """Per-op time, sparse vs dense, at one step (timers inside the wrappers)."""
    st = pipe.state
    sched = pipe.fresh_scheduler(len(orig.latents))
    t = sched.timesteps[step_idx]
    z = orig.latents[step_idx - 1]
    res = {}
    st.set_mask(mask)
    try:
        for sp in (False, True, False, True):
            st.op_times.clear()
            st.timing = True
            st.mode = "edit" if sp else "off"
            st.sparse, st.step = sp, step_idx
            st.set_cache(orig.cache)
            pipe.unet_eps(z, t, emb, sched)
            res[sp] = dict(st.op_times)
    finally:
        st.timing, st.mode, st.sparse, st.cache = False, "off", False, None
    rows = []
    ws = wrappers(pipe.c.unet)
    for name, td in res[False].items():
        ts = res[True].get(name)
        if ts is None:
            continue
        w = ws[name]
        cap = None
        if isinstance(w, CachedConv2d) and name in st.op_shapes:
            hw = st.op_shapes[name][1]
            if hw[0] * hw[1] >= st.conv_min_cells:
                frac = float(w.active_cells(hw).float().mean())
                cap = 1.0 / frac if frac else math.inf
        rows.append({"op": name, "kind": w.kind, "dense_ms": td * 1e3, "sparse_ms": ts * 1e3,
                     "speedup": td / ts if ts else math.inf, "cap": cap})
    return rows


def block_sweep(pipe, orig, emb, mask, step_idx, blocks):
    out = {}
    keep = pipe.state.block
    try:
        for b in blocks:
            pipe.state.set_block(b)
            d, s = step_pair_times(pipe, orig, emb, mask, step_idx, 1)
            out[b] = statistics.median(d) / statistics.median(s)
    finally:
        pipe.state.set_block(keep)
    return out


def run_real(system, job: JobContext) -> RunResult:
    cfg, wl = system.cfg, job.workload
    malloc = host_malloc_in_force(wl.host_malloc)  # before the models allocate
    pipe, device, dtype = setup(system, job)
    N = wl.num_steps
    k = system.mask_steps(N)
    budget = cfg.cache_budget_bytes or math.inf
    return REAL_RUNS.get(cfg.variant)(system, job, pipe, device, N, k, budget, malloc)


def _run_diffusers_dense(system, job: JobContext, pipe, device, N: int, k: int, budget: float, malloc) -> RunResult:
    wl = job.workload
    times = [diffusers_dense_run(pipe, job, wl.edited_prompt) for _ in range(wl.repeats)]
    return RunResult(metrics={"e2e_time_s": Metric.from_samples(times, "s", "lower"),
                              "step_time_s": Metric.from_samples([t / N for t in times], "s", "lower")},
                     info={"variant": "diffusers_dense", "device": str(device), "num_steps": N,
                           "host_malloc": malloc, **launch_info(pipe)})


def _run_dense_edit(system, job: JobContext, pipe, device, N: int, k: int, budget: float, malloc) -> RunResult:
    wl = job.workload
    runs = [pipe.dense(wl.edited_prompt, seed=job.seed, num_steps=N) for _ in range(wl.repeats)]
    steps = [t for r in runs for t in r.step_times_s]
    return RunResult(metrics={"e2e_time_s": Metric.from_samples([r.total_s for r in runs], "s", "lower"),
                              "step_time_s": Metric.from_samples(steps, "s", "lower")},
                     info={"variant": "dense_edit", "device": str(device), "num_steps": N,
                           "host_malloc": malloc, **launch_info(pipe)})


def _run_fisedit(system, job, pipe, device, N, k, budget, malloc) -> RunResult:
    cfg, wl = system.cfg, job.workload
    seed_edit = job.seed if wl.edit_seed is None else wl.edit_seed
    t0 = time.perf_counter()
    orig = pipe.record(wl.prompt, seed=job.seed, num_steps=N, budget_bytes=budget)
    record_s = time.perf_counter() - t0
    cache = orig.cache
    if wl.edit_scheduler:
        pipe.c.scheduler = build_scheduler(wl.edit_scheduler)
    mask = make_mask(job, pipe, wl.mask_ratio) if wl.mask_ratio is not None else None
    schedule = EDIT_SCHEDULES.get(cfg.schedule)
    if not schedule.captures_mask and mask is None:
        # a mask "supplied" by a capture pass (k dense steps), paid outside the timed edit
        probe = pipe.edit(wl.edited_prompt, seed=seed_edit, num_steps=N, cache=cache, schedule="online",
                          mask_steps=k, mask_method=cfg.mask_method, decode=False)
        mask = probe.mask if probe.mask is not None else torch.ones(pipe.latent_hw, dtype=torch.bool)

    def fis():
        return pipe.edit(wl.edited_prompt, seed=seed_edit, num_steps=N, cache=cache, schedule=cfg.schedule,
                         mask_steps=k, mask_method=cfg.mask_method, dense_fallback_ratio=cfg.dense_fallback_ratio,
                         **schedule.mask_args(mask))

    edits, denses, diffs = [], [], []
    for r in range(wl.repeats):
        order = ["fis", "dense", "diff"][r % 3:] + ["fis", "dense", "diff"][:r % 3]
        for what in order:
            if what == "fis":
                edits.append(fis())
            elif what == "dense" and cfg.controls:
                denses.append(pipe.dense(wl.edited_prompt, seed=seed_edit, num_steps=N))
            elif what == "diff" and cfg.controls:
                diffs.append(diffusers_dense_run(pipe, job, wl.edited_prompt))
    ed = edits[-1]
    used_mask = ed.mask if ed.mask is not None else torch.ones(pipe.latent_hw, dtype=torch.bool)
    f_latent = float(used_mask.float().mean())
    emb = pipe.encode(wl.edited_prompt)
    sparse_idx = [i for i, p in enumerate(ed.phases) if p == "sparse"]
    step_idx = sparse_idx[len(sparse_idx) // 2] if sparse_idx else N // 2
    metrics: dict = {}
    info: dict = {"variant": "fisedit", "schedule": cfg.schedule, "device": str(device), "num_steps": N,
                  "host_malloc": malloc,
                  "mask_steps": k, "block": cfg.block, "approx_groupnorm": cfg.approx_groupnorm,
                  "phases": ed.phases, "dense_fallback": ed.dense_fallback, "mask_info": ed.mask_info,
                  "mask_source": "synthetic" if wl.mask_ratio is not None else "captured",
                  "cache_bytes": cache.nbytes, "cache_skipped_steps": list(cache.skipped_steps),
                  "engine_counts": {}}

    # theoretical caps from the traced ops (FLOPs) with this very mask
    ops = trace_unet_ops(wl.unet, batch=2)
    st = pipe.state
    th = Thresholds(st.conv_min_cells, st.linear_min_cells, st.attn_min_cells)
    sc = step_cost(ops, used_mask, th, pipe.latent_hw, block=st.block)
    cap_step = sc.flops_cap
    n_sparse = sum(1 for p in ed.phases if p == "sparse")
    cap_e2e = N / ((N - n_sparse) + n_sparse / cap_step) if n_sparse else 1.0
    spec_cap = N / (k + (N - k) * f_latent) if f_latent else N / k

    if sparse_idx and not ed.dense_fallback:
        d, s = step_pair_times(pipe, orig, emb, used_mask, step_idx, wl.step_repeats)
        if pipe.state.fast:
            info["plans"] = pipe.state.plans.summary()  # the plans the timed sparse step ran with
        metrics["sparse_step_speedup"] = Metric.from_samples([a / b for a, b in zip(d, s)], "x", "higher")
        metrics["sparse_step_time_s"] = Metric.from_samples(s, "s", "lower")
        metrics["dense_step_time_s"] = Metric.from_samples(d, "s", "lower")
    metrics["step_speedup_cap"] = Metric.scalar(cap_step, "x", "higher")
    metrics["e2e_speedup_cap"] = Metric.scalar(cap_e2e, "x", "higher")
    metrics["e2e_speedup_cap_spec_formula"] = Metric.scalar(spec_cap, "x", "higher")
    metrics["mask_ratio"] = Metric.scalar(f_latent, "fraction", "lower")
    metrics["sparse_flops_fraction"] = Metric.scalar(sc.sparse_flops / sc.dense_flops, "fraction", "lower")
    metrics["e2e_time_s"] = Metric.from_samples([e.total_s for e in edits], "s", "lower")
    metrics["record_time_s"] = Metric.scalar(record_s, "s", "lower")
    metrics["cache_bytes"] = Metric.scalar(cache.nbytes, "bytes", "lower")
    sp_steps = [t for e in edits for t, p in zip(e.step_times_s, e.phases) if p == "sparse"]
    if sp_steps:
        metrics["sparse_phase_step_time_s"] = Metric.from_samples(sp_steps, "s", "lower")
    if denses:
        pairs = [d.total_s / e.total_s for d, e in zip(denses, edits)]
        metrics["e2e_speedup_vs_dense_edit"] = Metric.from_samples(pairs, "x", "higher")
        metrics["dense_edit_e2e_time_s"] = Metric.from_samples([d.total_s for d in denses], "s", "lower")
    if diffs:
        metrics["e2e_speedup_vs_diffusers_dense"] = Metric.from_samples([d / e.total_s for d, e in zip(diffs, edits)],
                                                                        "x", "higher")
        metrics["diffusers_dense_e2e_time_s"] = Metric.from_samples(diffs, "s", "lower")

    # fidelity (latents): outside the mask vs the original; inside vs the dense edit
    outside = ~used_mask
    rng = float(orig.latent.max() - orig.latent.min())
    metrics["psnr_outside_db"] = Metric.scalar(min(psnr(orig.latent, ed.latent, outside, rng), 999.0), "dB", "higher")
    metrics["ssim_outside"] = Metric.scalar(ssim(orig.latent, ed.latent, outside, rng), "ssim", "higher")
    if orig.image is not None and ed.image is not None:  # pixels in [-1, 1]: data range 2
        scale = orig.image.shape[-1] // pipe.latent_hw[1]
        pix_out = torch.nn.functional.interpolate(outside[None, None].float(), scale_factor=scale)[0, 0] > 0
        metrics["psnr_outside_image_db"] = Metric.scalar(min(psnr(orig.image, ed.image, pix_out, 2.0), 999.0),
                                                         "dB", "higher")
    if denses:
        ref = denses[-1].latent
        r2 = float(ref.max() - ref.min())
        metrics["psnr_inside_vs_dense_db"] = Metric.scalar(min(psnr(ref, ed.latent, used_mask, r2), 999.0), "dB", "higher")
        metrics["psnr_vs_dense_edit_db"] = Metric.scalar(min(psnr(ref, ed.latent, None, r2), 999.0), "dB", "higher")
        metrics["ssim_vs_dense_edit"] = Metric.scalar(ssim(ref, ed.latent, None, r2), "ssim", "higher")
    metrics["dense_fallback"] = Metric.scalar(1.0 if ed.dense_fallback else 0.0, "bool", "lower")

    if cfg.profile_layers and sparse_idx and not ed.dense_fallback:
        rows = layer_profile(pipe, orig, emb, used_mask, step_idx)
        rows.sort(key=lambda r: -r["dense_ms"])
        info["layers_top"] = [{k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in r.items()} for r in rows[:12]]
        by_kind: dict = {}
        for r in rows:
            a = by_kind.setdefault(r["kind"], [0.0, 0.0])
            a[0] += r["dense_ms"]
            a[1] += r["sparse_ms"]
        info["layers_by_kind_ms"] = {kk: {"dense": round(v[0], 2), "sparse": round(v[1], 2)} for kk, v in by_kind.items()}
        convs = [r for r in rows if r["kind"] == "conv" and r["cap"]]
        if convs:
            top = convs[0]
            metrics["layer_speedup_top_conv"] = Metric.scalar(top["speedup"], "x", "higher")
            metrics["layer_speedup_top_conv_cap"] = Metric.scalar(top["cap"], "x", "higher")
            info["top_conv"] = top["op"]
        if cfg.block_sweep:
            sweep = block_sweep(pipe, orig, emb, used_mask, step_idx, cfg.block_sweep)
            best = max(sweep, key=sweep.get)
            info["block_sweep_step_speedup"] = {str(b): round(v, 3) for b, v in sweep.items()}
            metrics["best_block_size"] = Metric.scalar(best, "cells", "higher")
            metrics["best_block_step_speedup"] = Metric.scalar(sweep[best], "x", "higher")
    if wl.session_prompts:
        _session(system, job, pipe, N, k, ed, seed_edit, metrics, info, cache)
    info["engine_counts"] = dict(pipe.state.counts)
    info.update(launch_info(pipe))
    _print_table(system.name, f_latent, metrics)
    res = RunResult(metrics=metrics, info=info)
    if wl.mask_ratio is not None and f_latent > 0 and "psnr_outside_db" in metrics \
            and not EDIT_SCHEDULES.get(cfg.schedule).captures_mask:
        if metrics["psnr_outside_db"].value < 30.0:
            res.mark_invalid(f"quality gate: psnr_outside_db {metrics['psnr_outside_db'].value:.1f} < 30 dB "
                             "(README quality gate)")
    return res


def _session(system, job, pipe, N, k, first, seed, metrics, info, orig_cache):
    """Serial rounds: round r edits round r-1's image; the cache is the one round r-1's edit
    recorded (a continuous edit). Each round is timed against a dense run of its prompt."""
    cfg, wl = system.cfg, job.workload
    schedule = EDIT_SCHEDULES.get(cfg.schedule)
    from impl.fisedit.cache import ActivationCache

    # round 1 again, recording its activations as the next round's cache
    prev_prompt = wl.edited_prompt
    rec = ActivationCache(budget_bytes=cfg.cache_budget_bytes or math.inf)
    cur = pipe.edit(prev_prompt, seed=seed, num_steps=N, cache=orig_cache,
                    schedule=cfg.schedule, mask_steps=k, **schedule.mask_args(first.mask),
                    dense_fallback_ratio=cfg.dense_fallback_ratio, record=rec, decode=False)
    rounds = []
    for r, prompt in enumerate(wl.session_prompts):
        m = synthetic_mask(pipe.latent_hw, wl.mask_ratio if wl.mask_ratio is not None else 0.1, wl.mask_shape,
                           seed=job.seed + r + 1)
        new_rec = ActivationCache(budget_bytes=cfg.cache_budget_bytes or math.inf)
        ed = pipe.edit(prompt, seed=seed, num_steps=N, cache=rec, schedule=cfg.schedule, mask_steps=k,
                       **schedule.mask_args(m),
                       dense_fallback_ratio=cfg.dense_fallback_ratio, record=new_rec)
        dn = pipe.dense(prompt, seed=seed, num_steps=N)
        rng = float(cur.latent.max() - cur.latent.min())
        rounds.append({"round": r + 2, "prompt": prompt, "edit_s": ed.total_s, "dense_s": dn.total_s,
                       "speedup_vs_dense_edit": dn.total_s / ed.total_s,
                       "psnr_outside_vs_previous_db": min(psnr(cur.latent, ed.latent, ~m, rng), 999.0),
                       "cache_bytes": new_rec.nbytes})
        cur, rec = ed, new_rec
    info["session_rounds"] = rounds
    metrics["session_round_speedup_vs_dense_edit"] = Metric.from_samples(
        [x["speedup_vs_dense_edit"] for x in rounds], "x", "higher")
    metrics["session_psnr_outside_vs_previous_db"] = Metric.from_samples(
        [x["psnr_outside_vs_previous_db"] for x in rounds], "dB", "higher")
    metrics["session_edit_time_s"] = Metric.from_samples([x["edit_s"] for x in rounds], "s", "lower")


def _print_table(name, f, m):
    def g(key, fmt="{:.2f}"):
        return fmt.format(m[key].value) if key in m else "-"

    print(f"[{name}] f={f:.3f}  sparse_step_speedup={g('sparse_step_speedup')}x (cap {g('step_speedup_cap')}x)  "
          f"e2e vs dense_edit={g('e2e_speedup_vs_dense_edit')}x vs diffusers_dense={g('e2e_speedup_vs_diffusers_dense')}x "
          f"(cap {g('e2e_speedup_cap')}x; spec formula {g('e2e_speedup_cap_spec_formula')}x)  "
          f"psnr_outside={g('psnr_outside_db', '{:.1f}')} dB  best block={g('best_block_size', '{:.0f}')}", flush=True)


# Each variant's real run once the pipeline is set up: FISEdit's sparse edit, or a dense baseline.
REAL_RUNS: Registry = Registry("value", "system.variant")
REAL_RUNS.add("fisedit", _run_fisedit)
REAL_RUNS.add("diffusers_dense", _run_diffusers_dense)
REAL_RUNS.add("dense_edit", _run_dense_edit)
