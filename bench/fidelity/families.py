"""What a fidelity job compares, per family, and what its simulator may take from the real run.

A family is the workload kind a simulator prices (``pipeline``, ``hybrid``, ``serving``,
``diffusion``). For each one this module names

- the headline metrics (real metric name, sim metric name, label): the end-to-end results the
  simulator predicts and is judged on;
- :func:`profile`, the only bridge from the real run to the simulated one: per-op times that a
  short profiling pass on the target machine measures (one padded F/B/W op, one layer, the
  isolated step of an engine), never the headline itself. Everything else (link latency and
  bandwidth, FLOP/s, memory bandwidth) comes from the calibrated hardware profile.

The simulated job then runs on the real job's workload with these fields replaced.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from impl.common.api import ConfigError, RunResult

# Workload kind -> family. A kind not listed is its own family (never measured until a row lands).
KIND_FAMILY = {"pipeline": "pipeline", "hybrid": "hybrid", "serving": "serving", "diffusion_edit": "diffusion"}


def family_of(workload_kind: Optional[str]) -> Optional[str]:
    if not workload_kind:
        return None
    return KIND_FAMILY.get(str(workload_kind), str(workload_kind))


@dataclass(frozen=True)
class Headline:
    label: str
    real_metric: str
    sim_metric: str
    sim_from_info: bool = False  # the sim reports it in info (e.g. FISEdit's dense step), not metrics


@dataclass
class Profile:
    """Workload fields the sim gets from the profiling pass, and where each came from."""

    workload: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    system: dict[str, Any] = field(default_factory=dict)  # knobs of the sim system (never a fitted constant)


def _metric(res: RunResult, name: str) -> Optional[float]:
    m = res.metrics.get(name)
    return None if m is None else float(m.value)


def _pipeline(real: RunResult, wl: Any, hw: Any = None) -> Profile:
    # Each real op is sleep-padded to op_pad_s unless its compute is longer: the profiled op
    # time is the larger of the pad and the slowest op kind's measured compute.
    raws = {k: _metric(real, f"raw_{k}_compute_s") for k in ("f", "b", "w", "bw")}
    measured = max([v for v in raws.values() if v] or [0.0])
    op = max(float(wl.op_pad_s), measured)
    if op <= 0:
        raise ConfigError("workload.op_pad_s: the pipeline fidelity job needs padded ops or raw op times")
    return Profile({"sim_op_time_s": op},
                   {"sim_op_time_s": f"max(op_pad_s={wl.op_pad_s:g}, profiled raw compute {measured:.4g} s)"})


def _hybrid(real: RunResult, wl: Any, hw: Any = None) -> Profile:
    # One layer's forward + backward per micro-batch, as padded (the tiny model's own compute is
    # well under its pads; the pad is what a per-layer profile of the rank measures).
    lt = float(wl.layer_fwd_pad_s) + float(wl.layer_bwd_pad_s)
    if lt <= 0:
        raise ConfigError("workload.layer_fwd_pad_s: the hybrid fidelity job needs padded layers")
    return Profile({"sim_layer_time_s": lt},
                   {"sim_layer_time_s": f"layer_fwd_pad_s + layer_bwd_pad_s = {lt:g} s per layer per micro-batch"})


def _prefill_rate(cost: Any, prompt_len: int, rank: int, t_prefill: Any, overhead_s: float) -> float:
    """The FLOP/s at which ``cost.prefill_s([prompt_len], [rank])`` equals the measured isolated
    prefill ``t_prefill`` (with ``overhead_s`` per iteration); 0 when it cannot be derived (no
    measurement, a weight-read-bound prefill, or a measurement below the overhead)."""
    import dataclasses as dc

    if not t_prefill or float(t_prefill) <= overhead_s:
        return 0.0
    c = dc.replace(cost, iteration_overhead_s=0.0, prefill_flops_per_s=0.0)
    if c.prefill_s([prompt_len], [rank], lora=False) <= c.weight_bytes / c.mem_bw_bytes_per_s:
        return 0.0  # weight-read bound: the FLOP rate does not set its time
    t_roof = c.prefill_s([prompt_len], [rank])
    return c.flops_per_s * t_roof / (float(t_prefill) - overhead_s)


def fit_overheads(batch: Sequence[int], excess_s: Sequence[float]) -> tuple[float, float]:
    """Least squares ``excess = c0 + c1 * B`` over profiled (batch size, step - roofline) points,
    both terms >= 0 (a negative one is dropped and the other refitted alone). One point, or one
    batch size: (its mean excess, 0)."""
    n = len(batch)
    if n != len(excess_s) or not n:
        raise ConfigError(f"fit_overheads: {n} batch sizes for {len(excess_s)} excess times")
    import numpy as np
    from scipy.optimize import nnls

    xs, ys = np.asarray(batch, dtype=float), np.asarray(excess_s, dtype=float)
    if np.ptp(xs) == 0:  # one batch size: the slope is not identified
        return max(0.0, float(ys.mean())), 0.0
    (c0, c1), _ = nnls(np.column_stack([np.ones(n), xs]), ys)
    return float(c0), float(c1)


def cpu_layer_overhead(cost: Any, prompt_len: int, prefills: Sequence[dict]) -> tuple[float, str]:
    """Serial cost per CPU-path layer of a CaraServe prefill (``cost.cpu_layer_overhead_s``):
    over isolated prefills of ``prompt_len`` tokens, each timed cold (``cpu_layers`` layers on the
    CPU path) and then resident (device path), the wall each cold one adds beyond what ``cost``
    already charges its CPU layers (``cost.cpu_layer_extra_s`` each: what the CPU path adds beyond the
    device layer), per CPU layer; the median
    over the prefills (one preempted pair on a shared host does not set it), >= 0. Returns
    (0, reason) when no prefill ran a CPU layer."""
    runs = [p for p in prefills if int(p["cpu_layers"]) > 0]
    if not runs:
        return 0.0, "no profiled prefill ran a layer on the CPU path"
    per_layer, excess = [], []
    for p in runs:
        n, r = int(p["cpu_layers"]), int(p["rank"])
        base = cost.prefill_s([prompt_len], [r]) / cost.num_layers
        priced = n * cost.cpu_layer_extra_s(((prompt_len, r),), base, overhead=False)
        excess.append(float(p["cold_s"]) - float(p["warm_s"]) - priced)
        per_layer.append(excess[-1] / n)
    per = max(0.0, statistics.median(per_layer))
    # the check that the cost is per layer, not per prefill: a + b x layers over the same points
    a, b = fit_overheads([int(p["cpu_layers"]) for p in runs], excess)
    layers = {}
    for p in runs:
        layers.setdefault(int(p["cpu_layers"]), []).append(float(p["cold_s"]) - float(p["warm_s"]))
    by_n = ", ".join(f"{n} layer(s): +{statistics.median(v) * 1e3:.2f} ms (n={len(v)})" for n, v in sorted(layers.items()))
    return per, (f"{len(runs)} isolated prefills of {prompt_len} tokens, cold minus resident, median by CPU layers: "
                 f"{by_n}; beyond what the sim charges the CPU path, median {per * 1e3:.3f} ms per CPU layer (least squares "
                 f"{a * 1e3:.2f} ms + {b * 1e3:.3f} ms x layers)")


def _serving(real: RunResult, wl: Any, hw: Any = None) -> Profile:
    # The sim prices the model the real run executes (its shape at fp32, the CPU run's dtype),
    # not the paper-scale one; prefill and decode come from the calibrated FLOP/s and memory
    # bandwidth. On a CPU host the real adapter copy is an emulated sleep: the sim gets its
    # per-rank time (a load-timing pass measures exactly that), never a TTFT.
    m = wl.model
    shape = {k: getattr(m, k) for k in ("name", "num_layers", "hidden", "heads", "kv_heads", "ffn_hidden",
                                         "vocab", "seq_len")}
    prof = Profile({"paper_model": {**shape, "dtype_bytes": 4}},
                   {"paper_model": f"the real model {m.name} (fp32, dtype_bytes 4)"})
    # Per-op profile: the real run times decode steps alone, at batch 1 (its SLO base) and, with
    # the engine's decode kernel, at a few batch sizes. On this CPU a step is mostly HF Llama's
    # per-layer Python and LoRA dispatch, not the roofline's weight read: the excess over the
    # roofline, fitted as c0 + c1 B, gives the per-iteration overhead c0 (the cost model's
    # iteration_overhead_s, 1 ms of GPU launches and sampling by default) and the per-row one c1
    # (iteration_overhead_per_row_s). FLOP/s stay the calibrated ones (sim_hardware local-t1:
    # the run's thread count).
    t_tpot = real.info.get("isolated_tpot_s")
    if hw is not None and t_tpot and real.info.get("isolated_prompt_len"):
        from impl.common.servesim.cost import ServingCost, ServingCostConfig
        from impl.common.workloads.serving import PaperModel

        L, r = int(real.info["isolated_prompt_len"]), int(real.info["isolated_rank"])
        c0 = ServingCost.from_profile(PaperModel(**shape, dtype_bytes=4), hw,
                                      ServingCostConfig(load_model="roofline", iteration_overhead_s=0.0))
        by_batch = real.info.get("isolated_decode_by_batch_s")
        if by_batch:
            ranks = [int(x) for x in real.info["isolated_decode_batch_ranks"]]
            kernel = "mbgmv" if real.info.get("isolated_decode_kernel") == "mbgmv" else "bgmv"
            pts = sorted((int(B), float(t)) for B, t in by_batch.items())
            roofs = [c0.decode_s([L + 1] * B, ranks[:B], kernel) for B, _ in pts]
            overhead, per_row = fit_overheads([B for B, _ in pts], [t - x for (_, t), x in zip(pts, roofs)])
            prof.system = {"cost": {"iteration_overhead_s": overhead, "iteration_overhead_per_row_s": per_row}}
            steps = ", ".join(f"B={B} {t * 1e3:.2f} ms (roofline {x * 1e3:.2f})" for (B, t), x in zip(pts, roofs))
            src = (f"decode steps ({real.info.get('isolated_decode_kernel')}) {steps}: least squares of step - roofline "
                   f"= {overhead * 1e3:.3f} ms + {per_row * 1e3:.3f} ms x B")
            prof.sources["cost.iteration_overhead_s"] = src
            prof.sources["cost.iteration_overhead_per_row_s"] = src
        else:  # a run without the batch profile: batch 1 only, no per-row term
            roof = c0.decode_s([L + 1], [r])
            overhead = max(0.0, float(t_tpot) - roof)
            prof.system = {"cost": {"iteration_overhead_s": overhead}}
            prof.sources["cost.iteration_overhead_s"] = (f"isolated decode step {float(t_tpot) * 1e3:.2f} ms - its "
                                                         f"roofline {roof * 1e3:.2f} ms")
        # The same profiling pass times one isolated prefill at the median prompt: its achieved
        # FLOP/s prices prefill (the calibrated rate is square matmuls; a CPU prefill's skinny
        # matmuls and per-token norm/rotary/softmax work run slower). Only where the roofline's
        # prefill is FLOP-bound, so the rate is what the measurement scales.
        rate = _prefill_rate(c0, L, r, real.info.get("isolated_prefill_s"), overhead)
        if rate:
            prof.system["cost"]["prefill_flops_per_s"] = rate
            prof.sources["cost.prefill_flops_per_s"] = (
                f"isolated prefill of {L} tokens {float(real.info['isolated_prefill_s']) * 1e3:.2f} ms: "
                f"{rate / 1e9:.1f} GFLOP/s achieved vs {c0.flops_per_s / 1e9:.1f} calibrated")
        # CaraServe's CPU path on the real engine: its worker processes are the sim's CPU cores,
        # and the hand-off to them that does not overlap the device layer is profiled (one
        # isolated prefill cold vs resident per adapter), priced per CPU layer.
        if real.info.get("cpu_workers"):
            prof.system["cost"]["cpu_cores"] = int(real.info["cpu_workers"])
            prof.sources["cost.cpu_cores"] = f"the real engine's CPU LoRA workers ({int(real.info['cpu_workers'])})"
        if real.info.get("isolated_cpu_prefills"):
            import dataclasses as dc

            sim_cost = dc.replace(c0, **prof.system["cost"])
            per, src = cpu_layer_overhead(sim_cost, L, real.info["isolated_cpu_prefills"])
            prof.system["cost"]["cpu_layer_overhead_s"] = per
            prof.sources["cost.cpu_layer_overhead_s"] = src
    # The real engine's adapter pool, not the paper-scale one the sim defaults to (sim_pool_slots
    # 64): with 4 slots and 32 cold adapters every request loads, with 64 a repeat never does.
    if real.info.get("pool_slots"):
        prof.system["sim_pool_slots"] = int(real.info["pool_slots"])
        prof.sources["sim_pool_slots"] = f"the real engine's adapter pool ({int(real.info['pool_slots'])} slots)"
    loads = real.info.get("emulated_load_s_by_rank")
    if loads:
        rk = sorted(int(r) for r in loads)
        if len(rk) == 1:  # one rank: a two-point table through the origin (bytes-proportional)
            rk = [0] + rk
        prof.system.setdefault("cost", {}).update({
            "load_table_ranks": rk, "load_table_times_s": [float(loads.get(r, loads.get(str(r), 0.0))) for r in rk]})
        prof.sources["cost.load_table"] = "the real run's emulated adapter-copy time per rank"
    return prof


def _diffusion(real: RunResult, wl: Any, hw: Any = None) -> Profile:
    # The simulator prices exactly the real UNet (unet=workload) at the real precision, mask
    # ratio and CFG batch; the engine gain of a fused GPU engine does not exist on this CPU run,
    # and the sparse step is priced for the engine the real run executes (sim_engine=reference).
    if wl.mask_ratio is None:
        raise ConfigError("workload.mask_ratio: the diffusion fidelity job needs a supplied mask ratio")
    f = float(wl.mask_ratio)
    return Profile({"sim": {"unet": "workload", "dtype": wl.dtype, "batch": 2, "engine_gain": 1.0,
                            "mask_mean": f, "mask_p90": min(0.99, max(f * 1.5, f + 0.01)),
                            "num_steps": wl.num_steps, "mask_steps": max(1, wl.num_steps // 5)}},
                   {"sim": "the real UNet, dtype, CFG batch 2 and mask ratio; engine_gain 1 (no fused engine)",
                    "system.sim_engine": "reference: the engine the real run executes (GroupNorm, activations, "
                                         "pad and clone over the full map)"},
                   {"sim_engine": "reference"})


# Per-dtype rates a calibrated profile must hold for the diffusion family: a profile calibrated
# before they existed would silently price those ops at the fallback rates.
DIFFUSION_RATES = ("conv_flops", "conv_window_flops", "window_gather_bytes_per_s", "window_scatter_bytes_per_s",
                   "cell_gather_bytes_per_s", "cell_scatter_bytes_per_s", "token_gather_bytes_per_s",
                   "token_scatter_bytes_per_s", "attn_flops", "linear_flops",
                   "activation_bytes_per_s", "elementwise_bytes_per_s")


def _diffusion_hw(hw: Any, wl: Any, hw_name: str) -> None:
    if not getattr(hw, "measured", False):
        return  # a datasheet profile prices at its fallbacks by design
    missing = [f"diffusion.{f}[{wl.dtype}]" for f in DIFFUSION_RATES if wl.dtype not in (getattr(hw.diffusion, f, None) or {})]
    if missing:
        raise ConfigError(f"system.sim_hardware: calibrated profile {hw_name} lacks {', '.join(missing)} (calibrated "
                          f"before these rates existed): delete conf/hardware/{hw_name}.yaml or re-run calibrate")


def _no_hw_check(hw: Any, wl: Any, hw_name: str) -> None:
    pass


@dataclass(frozen=True)
class Family:
    name: str
    headlines: tuple[Headline, ...]
    profile: Callable[..., Profile]  # (real result, workload, calibrated hardware profile)
    # (sim hardware, workload, its name): raises when the profile cannot price the family
    check_hw: Callable[..., None] = _no_hw_check


FAMILIES: dict[str, Family] = {
    "pipeline": Family("pipeline", (Headline("iteration_time_s", "iteration_time_s", "iteration_time_s"),), _pipeline),
    "hybrid": Family("hybrid", (Headline("iteration_time_s", "iteration_time_s", "iteration_time_s"),), _hybrid),
    "serving": Family("serving", (Headline("ttft_mean_s", "ttft_mean_s", "ttft_mean_s"),), _serving),
    "diffusion": Family("diffusion", (
        Headline("sparse_step_speedup", "sparse_step_speedup", "sparse_step_speedup"),
        Headline("dense_step_time_s", "dense_step_time_s", "dense_step_diffusers_s", sim_from_info=True)), _diffusion,
        _diffusion_hw),
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"system.family: unknown family {name!r} (one of: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]
