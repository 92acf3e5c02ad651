"""Real mode (real experiments A-D of README.md): measured on CPU with tiny random-weight models;
records say which pieces are emulated (the remote LoRA store)."""
from __future__ import annotations

import math
import statistics

import torch

from impl.common.api import JobContext, Metric, RunResult
from impl.common.execution import set_torch_threads
from impl.swiftdiffusion.variants import VARIANTS


def _mean(xs) -> float:
    return float(statistics.fmean(xs))


def _lat(samples, better="lower") -> Metric:
    return Metric.from_samples(samples, "s", better)


# A distributed path whose output strays from its one-process reference by more than this
# (relative to the reference's magnitude) is not the same computation: its timing is invalid.
EQUAL_RTOL = 1e-5
# The same in half precision on a GPU ([R] 1e-2 relative for fp16, README.md): the diffusers pipeline
# fuses W + s B@A with its own rounding, so its latents are not ours bit for bit there.
EQUAL_RTOL_HALF = 1e-2
# The loops that take the channels_last flag (UNet and ControlNets converted, NHWC inputs); in
# the multi-process ones tensors cross gloo in the default layout. lora_api times API calls only.
CHANNELS_LAST_SCENARIOS = ("controlnet", "cfg", "bal", "quality")


# Scenarios whose models run in one process (the base worker of ``bal``: its loader ranks only
# read files into host memory): on the job's device and dtype. ``controlnet`` and ``cfg`` put
# one model part per rank on gloo ranks, on the CPU (several ranks on one GPU are not built).
DEVICE_SCENARIOS = ("bal", "lora_api", "quality")


def run_real(system, job: JobContext) -> RunResult:
    wl, cfg, ex = job.workload, system.cfg, job.execution
    if wl.torch_threads > 0:
        set_torch_threads(wl.torch_threads)
    applied = cfg.channels_last and wl.scenario in CHANNELS_LAST_SCENARIOS
    on_device = wl.scenario in DEVICE_SCENARIOS
    device = ex.torch_device() if on_device else torch.device("cpu")
    dtype = ex.torch_dtype(None, field_name="execution.dtype") if on_device else None
    info = {"dtype": str(dtype or torch.float32).replace("torch.", ""), "backbone": {
        "cuda_graphs": cfg.cuda_graphs, "channels_last": cfg.channels_last, "channels_last_applied": applied,
        "note": "CUDA graphs and fused CUDA kernels are not built (recorded, not applied); "
                f"channels_last is applied in scenarios {', '.join(CHANNELS_LAST_SCENARIOS)}"}}
    if on_device:  # the multi-rank scenarios' device and backend come from the launch's placement
        info["device"] = device.type
        if ex.is_cuda:
            info["gpu_name"] = ex.gpu_name
    if wl.scenario == "bal":
        info["placement"] = f"base worker (rank 0) on {device.type}; LoRA loader ranks on the CPU (gloo)"
    elif not on_device:
        info["placement"] = f"{wl.scenario}: gloo ranks on the CPU (one model part per rank)"
    execution = ex if on_device else None
    m, emulated, mismatch = {}, [], None
    if wl.scenario == "controlnet":
        from impl.swiftdiffusion.controlnet_service import run_service

        k = wl.num_controlnets
        r = run_service(wl, job.seed, k, list(wl.cn_scales[:k]), cfg.aggregation, cfg.cn_cache, channels_last=applied)
        svc, loc = r["service_s"], r["local_s"]
        m["latency_s"] = _lat(svc)
        m["throughput_rps"] = Metric.scalar(1.0 / _mean(svc), "req/s", "higher")
        m["latency_local_s"] = _lat(loc)
        m["speedup_vs_local"] = Metric.scalar(_mean(loc) / _mean(svc), "x", "higher")
        m["speedup_bound"] = Metric.scalar(r["bound"], "x", "higher")
        for key in ("t_down_s", "t_cn_s", "t_rest_s", "t_comm_s"):
            m[key] = Metric.scalar(r[key], "s")
        m["max_abs_diff_vs_local"] = Metric.scalar(r["max_abs_diff"], "abs")
        info["servers"] = r["servers"]
        info["aggregation"] = cfg.aggregation
        if r["max_abs_diff"] > EQUAL_RTOL * r["ref_abs_max"]:
            mismatch = f"ControlNet service output differs from the one-process run by {r['max_abs_diff']:.3g}"
    elif wl.scenario == "cfg":
        from impl.swiftdiffusion.cfg_parallel import run_cfg

        r = run_cfg(wl, job.seed, channels_last=applied)
        m["latency_s"] = _lat(r["parallel_s"])
        m["throughput_rps"] = Metric.scalar(1.0 / _mean(r["parallel_s"]), "req/s", "higher")
        m["latency_batched_s"] = _lat(r["batched_s"])
        m["speedup_vs_batched"] = Metric.scalar(_mean(r["batched_s"]) / _mean(r["parallel_s"]), "x", "higher")
        m["max_abs_diff_vs_batched"] = Metric.scalar(r["max_abs_diff"], "abs")
        m["max_rel_diff_vs_batched"] = Metric.scalar(r["max_abs_diff"] / r["ref_abs_max"], "rel")
        if r["max_abs_diff"] > EQUAL_RTOL * r["ref_abs_max"]:
            mismatch = f"CFG-parallel latents differ from the batched step by {r['max_abs_diff']:.3g}"
    elif wl.scenario == "bal":
        from impl.swiftdiffusion.bal_run import run_bal

        r = run_bal(wl, job.seed, list(wl.k_grid), channels_last=applied, execution=execution)
        emulated.append(r["storage"])
        best = min(wl.k_grid, key=lambda k: _mean(r["times"][f"k{k}"]))
        m["latency_s"] = _lat(r["times"][f"k{max(wl.k_grid)}"])
        m["throughput_rps"] = Metric.scalar(1.0 / _mean(r["times"][f"k{max(wl.k_grid)}"]), "req/s", "higher")
        m["latency_sync_merge_s"] = _lat(r["times"]["sync"])
        # the Diffusers baseline = the pipeline API; the model-level API as a named variant
        m["latency_diffusers_s"] = _lat(r["times"]["diffusers_pipeline"])
        m["latency_diffusers_model_s"] = _lat(r["times"]["diffusers_model"])
        m["diffusers_load_fuse_s"] = _lat(r["pipeline_load_fuse_s"])
        m["diffusers_unfuse_unload_s"] = _lat(r["pipeline_unfuse_unload_s"])
        m["diffusers_model_load_fuse_s"] = _lat(r["load_fuse_s"])
        m["diffusers_model_unfuse_unload_s"] = _lat(r["unfuse_unload_s"])
        for v in ("diffusers_pipeline", "diffusers_model"):
            m[f"max_rel_diff_{v}_vs_sync"] = Metric.scalar(max(r[f"{v}_vs_sync_max_rel"]), "rel")
        m["diffusers_pipeline_weight_drift"] = Metric.scalar(max(r["pipeline_weight_drift"]), "abs")
        for k in wl.k_grid:
            v = f"k{k}"
            m[f"latency_k{k}_s"] = _lat(r["times"][v])
            m[f"patch_step_k{k}"] = Metric.from_samples(r["patch"][v], "step")
            ps = [q[0] for q in r["quality"][v]]
            m[f"psnr_k{k}_db"] = Metric.from_samples([p if math.isfinite(p) else 999.0 for p in ps], "dB", "higher")
            m[f"ssim_k{k}"] = Metric.from_samples([q[1] for q in r["quality"][v]], "ssim", "higher")
        kmax = _mean(r["times"][f"k{max(wl.k_grid)}"])
        m["speedup_vs_diffusers"] = Metric.scalar(_mean(r["times"]["diffusers_pipeline"]) / kmax, "x", "higher")
        m["speedup_vs_diffusers_model"] = Metric.scalar(_mean(r["times"]["diffusers_model"]) / kmax, "x", "higher")
        info.update(controlnets_per_request=wl.num_controlnets,
                    diffusers_pipeline=r["pipeline"],
                    k0_bit_identical=all(r["k0_equal"]), pristine_after_every_request=all(r["pristine_after"]),
                    best_k=best, psnr_note="999 dB stands for identical latents (inf)")
        if not all(r["k0_equal"]) or not all(r["pristine_after"]):
            res = RunResult(m, emulated=emulated, info=info)
            res.mark_invalid("BAL K=0 not bit-identical to the synchronous merge, or weights not pristine")
            return res
        worst = max(r["diffusers_pipeline_vs_sync_max_rel"])
        rtol = EQUAL_RTOL if dtype in (None, torch.float32) else EQUAL_RTOL_HALF
        info["equal_rtol"] = rtol
        if worst > rtol:
            mismatch = f"the Diffusers pipeline's latents differ from the synchronous merge by {worst:.3g} (relative)"
    elif wl.scenario == "quality":
        from impl.swiftdiffusion.baselines import run_quality

        ks = sorted({cfg.nirvana_k, *wl.nirvana_k_grid})
        r = run_quality(wl, job.seed, list(wl.k_grid), ks, wl.nirvana_prompt_noise, channels_last=applied,
                        device=device, dtype=dtype)
        for v, q in r["quality"].items():
            ps = [x[0] for x in q]
            m[f"psnr_{v}_db"] = Metric.from_samples([p if math.isfinite(p) else 999.0 for p in ps], "dB", "higher")
            m[f"ssim_{v}"] = Metric.from_samples([x[1] for x in q], "ssim", "higher")
        for v, ts in r["times"].items():
            m[f"latency_{v}_s"] = _lat(ts)
        own = VARIANTS.get(cfg.variant).quality_path(cfg, wl)
        m["latency_s"] = _lat(r["times"][own])
        m["throughput_rps"] = Metric.scalar(1.0 / _mean(r["times"][own]), "req/s", "higher")
        info.update(own_path=own, nirvana_start_step=r["nirvana_start"], reference="LoRAs merged before step 0",
                    psnr_note="999 dB stands for identical latents (inf)")
        if not all(r["pristine_after"]):
            res = RunResult(m, info=info)
            res.mark_invalid("base weights not pristine after a request")
            return res
    elif wl.scenario == "lora_api":
        from impl.swiftdiffusion.lora_api import run_lora_api

        r = run_lora_api(wl, job.seed, device=device, dtype=dtype)
        med = r["median"]
        for k, v in r["samples"].items():
            m[k] = _lat(v)
        m["diffusers_load_fuse_s"] = Metric.scalar(med["diffusers_load_fuse_s"], "s")
        m["direct_load_merge_s"] = Metric.scalar(med["direct_load_merge_s"], "s")
        m["direct_vs_load_fuse_x"] = Metric.scalar(med["direct_vs_load_fuse_x"], "x", "higher")
        m["latency_s"] = Metric.scalar(med["direct_load_merge_s"] + med["direct_restore_s"], "s")
        m["throughput_rps"] = Metric.scalar(1.0 / m["latency_s"].value, "req/s", "higher")
        info["rank"] = r["rank"]
    res = RunResult(m, emulated=emulated, info=info)
    if mismatch:
        res.mark_invalid(mismatch)
    return res
