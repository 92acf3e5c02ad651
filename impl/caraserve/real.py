"""Real mode (the real experiments of impl/caraserve/README.md): the serving engine on a Llama with random weights and PEFT
(or, ``system.adapter_source: random``, directly drawn) adapters.

Where the work runs is the job's :class:`~impl.common.execution.Execution` (``execution=``):
- ``cpu``: the model, the "device" path and the CPU path share the host; the adapter H2D copy is
  emulated: a loader thread sleeps ``load_rho x T_prefill(isolated) x bytes_paper(r) / mean
  bytes_paper`` (so rho = T_load / T_prefill for a mean adapter), labelled in
  ``provenance.emulated``.
- ``cuda``: the base model and resident adapters on the GPU in the job's dtype; the host
  adapters pinned; a cold adapter's groups copied with non-blocking copies on a side stream
  while its prefill LoRA deltas come from the CPU worker (activations copied to the host, fp32
  deltas added back on the GPU), then the GPU kernel; nothing is emulated.
The CaraServe CPU path runs in a spawned worker process over shared memory. Systems named in
``interleave`` run on the same trace in the same job, rotating the order every round.
"""
from __future__ import annotations

import copy
import statistics
import tempfile
import time

import numpy as np
import torch

from impl.caraserve.policies import serving
from impl.common.api import ConfigError, JobContext, Metric, RunResult
from impl.common.llm.serving_engine import EngineRequest, ServingEngine, time_decode_batches
from impl.common.llm.lora import AdapterSpec, adapters_from_peft, load_peft_model, make_peft_model, save_adapters
from impl.common.llm.metrics import check_conservation, serving_metrics
from impl.common.llm.model import build_llama, synthetic_prompt


def build_models(job: JobContext, adapter_ranks: dict, seed: int, device=None, dtype=None, source: str = "peft"):
    """Base model (plain HF Llama) on ``device`` in ``dtype`` (default: the CPU, fp32) and host
    adapters in the same dtype, pinned for a CUDA device. ``source``: "peft" = created, saved
    and re-loaded with PEFT (the model is built on the CPU in fp32 first, as always);
    "random" = :func:`random_adapters` and the model built on the device (a 7B shape)."""
    from impl.common.llm.lora import random_adapters

    wl = job.workload
    device = torch.device(device or "cpu")
    dtype = dtype or torch.float32
    specs = [AdapterSpec(a, r, use_rslora=wl.adapters.use_rslora) for a, r in sorted(adapter_ranks.items())]
    if source == "random":
        base = build_llama(wl.model, seed, device=device, dtype=dtype)
        host = random_adapters(wl.model, specs, seed=seed + 1, device=device, dtype=dtype)
        return base, {k: v.pin(device) for k, v in host.items()}
    base = build_llama(wl.model, seed)
    pm = make_peft_model(copy.deepcopy(base), specs, seed=seed + 1)
    with tempfile.TemporaryDirectory() as d:
        save_adapters(pm, d)
        del pm
        pm2 = load_peft_model(copy.deepcopy(base), d, [s.name for s in specs])
        host = adapters_from_peft(pm2, [s.name for s in specs])
    del pm2
    base = base.to(device, dtype)
    return base, {k: v.to("cpu", dtype).pin(device) for k, v in host.items()}


def _isolated(model, adapters, name, prompt, steps=4):
    from impl.common.llm.serving_engine import run_alone

    t0 = time.perf_counter()
    run_alone(model, adapters, name, prompt, 1)
    t_pre = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_alone(model, adapters, name, prompt, steps)
    t_all = time.perf_counter() - t0
    return t_pre, max(1e-6, (t_all - t_pre) / max(1, steps - 1))


def run_real(system, job: JobContext) -> RunResult:
    from tqdm import tqdm

    from impl.common.llm.lora import rank_bytes_paper

    c, wl = system.cfg, job.workload
    ex = job.execution  # the job's one device decision (conf/execution/), never re-guessed here
    ex.apply_threads(wl.torch_threads)
    device = ex.device
    dtype = ex.torch_dtype(None, field_name="execution.dtype")
    trace = system.trace(job)
    used = sorted({r.adapter for r in trace.requests})
    ranks = {a: trace.adapters[a] for a in used}
    t_build = time.perf_counter()
    base, adapters = build_models(job, ranks, job.seed, ex.torch_device(), dtype, c.adapter_source)
    t_build = time.perf_counter() - t_build
    # The calibration passes below run the device path outside the engine: they read resident
    # copies of the adapters they use (the engine's own come from its loader).
    resident_cache: dict = {}

    def resident(names):
        for a in names:
            if a not in resident_cache:
                resident_cache[a] = adapters[a].to(ex.torch_device(), dtype)
        return resident_cache

    rng = np.random.default_rng(job.seed + 7)
    prompts = [synthetic_prompt(r.prompt_len, rng) for r in trace.requests]

    # Calibrate: isolated prefill at the median prompt and batch-1 TPOT (the SLO base), median of 3.
    med = int(np.median([r.prompt_len for r in trace.requests]))
    name0 = used[0]
    for _ in range(max(1, wl.warmup_requests)):
        _isolated(base, resident([name0]), name0, prompts[0][:med] or [4])
    iso = [_isolated(base, resident([name0]), name0, (prompts[0] * 4)[:med]) for _ in range(3)]
    t_prefill = statistics.median(x[0] for x in iso)
    t_tpot = statistics.median(x[1] for x in iso)
    # Decode steps at a few batch sizes (rows on distinct trace adapters, the engine's decode
    # kernel): the per-row cost a batch-1 step cannot show (the fidelity profile fits it). Rows
    # go largest rank first, so every size pads to the same rank and the slope is per row, not
    # the padded kernel's extra rank chunks. The scheduler never mixes prefill and decode rows in
    # one iteration, so there is no mixed step to time.
    from impl.common.llm.scheduler import kernels_of

    dec_kernel = kernels_of(system.sched_config())[1]
    sizes = sorted({min(b, c.max_batch) for b in (1, 2, 4, 8)})
    rows = sorted(used, key=lambda a: (-ranks[a], a))
    by_batch = time_decode_batches(base, resident(rows[:max(sizes)]), rows, (prompts[0] * 4)[:med], sizes,
                                   dec_kernel)
    resident_cache.clear()  # the engines load their own copies
    pm_ = wl.paper_model
    bytes_of = {a: rank_bytes_paper(pm_.hidden, pm_.num_layers, r) for a, r in ranks.items()}
    mean_bytes = float(np.mean([bytes_of[r.adapter] for r in trace.requests]))
    emulate = device == "cpu"
    hw = job.hardware
    seconds_for = (lambda a: wl.load_rho * t_prefill * bytes_of[a] / mean_bytes) if emulate else None
    a10_load = mean_bytes / (hw.host_link_bw_bytes_per_s * c.cost.h2d_efficiency) if hw.host_link_bw_bytes_per_s else 0.0

    reqs = [EngineRequest(rid=r.rid, arrival_s=r.arrival_s, adapter=r.adapter, prompt=prompts[i],
                          output_len=r.output_len) for i, r in enumerate(trace.requests)]
    # The SLO (the paper's, as Toppings states it): slo_scale x the mean per-token latency of the same trace on
    # the same engine and batching with the base model alone (no LoRA: no load, no delta), one
    # run before the measured ones; or (slo_reference=isolated) x the isolated batch-1 TPOT.
    slo_ref = {"kind": "isolated", "slo_scale": wl.slo_scale, "tpot_s": t_tpot, "slo_tpot_s": wl.slo_scale * t_tpot}
    if wl.slo_reference == "base":
        eng = ServingEngine(base, adapters, system.sched_config(c.policy), device=device, lora=False)
        try:
            st0 = eng.serve(reqs)
        finally:
            eng.close()
        tp = [r.tpot_s for r in st0.records if r.output_len > 1]
        tpot0 = sum(tp) / len(tp) if tp else t_tpot
        slo_ref = {"kind": "base", "system": "base model, no LoRA", "policy": "cached", "requests": len(reqs),
                   "tpot_mean_s": tpot0, "slo_scale": wl.slo_scale, "slo_tpot_s": wl.slo_scale * tpot0,
                   "engine": {"loads": st0.loads, "cpu_jobs": st0.cpu_jobs, "cpu_layers": st0.cpu_layers,
                              "lora_rows": st0.lora_rows}}
    slo = slo_ref["slo_tpot_s"]
    for q in reqs:
        q.slo_tpot_s = slo
    policies = [c.policy] + [p for p in c.interleave if p != c.policy]
    worker = None
    if any(serving(p).cpu_assisted_prefill for p in policies) and c.cpu_workers > 0:
        from impl.caraserve.cpu_prefill import CPULoRAWorker

        worker = CPULoRAWorker(adapters, job.out_dir, max_rows=max(len(p) for p in prompts) + 8)
    # CaraServe's CPU-assisted prefill, isolated: the median prompt cold (loader copying, the
    # worker computing the LoRA part of the first layers) and then resident (device path), on two
    # trace adapters of each rank, 2 rounds. The difference is the CPU path's cost that does not
    # overlap the device layer (the fidelity profile prices it per CPU layer). Each prefill comes
    # after an idle gap, as the trace's requests do: a hand-off to a worker that has slept costs
    # more per cold prefill than one back to back; the gap is the trace's mean inter-arrival
    # time, capped at 0.3 s, past which that cost stops growing.
    cpu_prefills, idle_s = None, 0.0
    if worker is not None:
        from impl.common.llm.serving_engine import time_cpu_assisted_prefills

        by_rank: dict = {}
        for a in sorted(used, key=lambda a: (ranks[a], a)):
            by_rank.setdefault(ranks[a], []).append(a)
        arr = sorted(r.arrival_s for r in trace.requests)
        idle_s = min(0.3, (arr[-1] - arr[0]) / (len(arr) - 1)) if len(arr) > 1 else 0.0
        probe = [a for k in range(2) for r in sorted(by_rank) for a in by_rank[r][k:k + 1]]
        try:
            cpu_prefills = time_cpu_assisted_prefills(base, adapters, system.sched_config("caraserve"), probe,
                                                      (prompts[0] * 4)[:med], seconds_for, worker, device,
                                                      reps=2, idle_s=idle_s)
        except BaseException:
            worker.close()
            raise
        worker.jobs, worker.wait_s = 0, 0.0  # the trace's own counts below
    runs: dict = {p: [] for p in policies}
    total = len(reqs) * len(policies) * wl.repeats
    try:
        with tqdm(total=total, desc=f"{system.name} real", disable=not job.show_progress, leave=False) as bar:
            for rnd in range(wl.repeats):
                k = rnd % len(policies)
                for pol in policies[k:] + policies[:k]:
                    eng = ServingEngine(base, adapters, system.sched_config(pol), seconds_for=seconds_for,
                                        cpu=worker if serving(pol).cpu_assisted_prefill else None, device=device)
                    try:
                        runs[pol].append(eng.serve(reqs, progress=bar))
                    finally:
                        eng.close()
    finally:
        if worker is not None:
            worker.close()

    def merged(pol):
        st = runs[pol]
        recs = [r for s in st for r in s.records]
        m = serving_metrics(recs, sum(s.arrived for s in st), sum(s.arrived - len(s.records) for s in st),
                            sum(s.makespan_s for s in st), sum(s.stall_s for s in st), sum(s.busy_s for s in st))
        return m, st, recs

    metrics, st, recs = merged(c.policy)
    result = RunResult(metrics=metrics)
    check_conservation(result, sum(s.arrived for s in st), len(recs), sum(s.arrived - len(s.records) for s in st))
    info = {"policy": c.policy, "device": device, "interleaved": policies, "rounds": wl.repeats,
            "pool_slots": c.pool_slots,  # the device adapter pool's slots (the sim's own is sim_pool_slots)
            "isolated_prefill_s": t_prefill, "isolated_tpot_s": t_tpot, "slo_tpot_s": slo, "slo_reference": slo_ref,
            "isolated_prompt_len": len((prompts[0] * 4)[:med]), "isolated_rank": int(ranks[name0]),
            # decode step at batch B (after a prefill of the isolated prompt; row i on adapter rows[i])
            "isolated_decode_by_batch_s": by_batch, "isolated_decode_kernel": dec_kernel,
            "isolated_decode_batch_ranks": [int(ranks[rows[i % len(rows)]]) for i in range(max(sizes))],
            "load_rho": wl.load_rho if emulate else None,
            # The emulated copy time of one adapter per rank (what a load-timing pass measures).
            "emulated_load_s_by_rank": ({int(r): seconds_for(a) for a, r in sorted(ranks.items())} if emulate else None),
            "a10_profile_load_s_mean_adapter": a10_load,
            "per_round_ttft_mean_s": {p: [float(np.mean([r.ttft_s for r in s.records])) for s in runs[p]] for p in policies},
            # the serving thread's CPU time / wall over its iterations less load stalls, per round
            # (well under 1: it sat off-CPU, e.g. preempted; a slow round with ~1 ran slower on-CPU).
            # Only with one torch thread: with more, the compute runs on OpenMP threads that
            # thread_time() does not see, so the share would read low without any preemption.
            "per_round_iteration_cpu_share": ({p: [s.busy_cpu_s / (s.busy_s - s.stall_s) if s.busy_s > s.stall_s
                                                   else None for s in runs[p]] for p in policies}
                                              if torch.get_num_threads() == 1 else None),
            # per round, per prefill iteration: [request ids, wall s, CPU-path layers]
            "per_round_prefills": {p: [s.prefill_log for s in runs[p]] for p in policies},
            "cpu_layers": sum(s.cpu_layers for s in st), "device_layers": sum(s.device_layers for s in st)}
    if worker is not None:
        info["cpu_workers"] = c.cpu_workers
        info["isolated_cpu_prefills"] = cpu_prefills
        info["isolated_cpu_prefills_idle_s"] = idle_s
        info["cpu_worker_jobs"] = worker.jobs
        info["cpu_worker_wait_s"] = worker.wait_s
    mine = metrics["ttft_mean_s"].value
    for p in policies[1:]:
        m, stp, recp = merged(p)
        check_conservation(result, sum(s.arrived for s in stp), len(recp), sum(s.arrived - len(s.records) for s in stp))
        for key in ("ttft_mean_s", "latency_mean_s", "tpot_mean_s", "stall_share"):
            if key in m:
                metrics[f"{p}_{key}"] = Metric.scalar(m[key].value, m[key].unit, m[key].better)
        theirs = m["ttft_mean_s"].value
        # their TTFT / ours: >1 = this system faster. For CACHED (<= 1 expected) closer to 1 is
        # better, i.e. higher too. Value, p10, p50, p90 are over the per-round ratios (one per
        # rotated round); the pooled ratio over all records goes to info.
        per = [float(np.mean([r.ttft_s for r in b.records])) / float(np.mean([r.ttft_s for r in a.records]))
               for a, b in zip(st, stp)]
        metrics[f"ttft_ratio_{p}_over_self"] = Metric.from_samples(per, "x", "higher")
        info.setdefault("ttft_ratio_pooled", {})[p] = theirs / mine
        info.setdefault("ttft_ratio_per_round", {})[p] = per
    info["dtype"] = str(dtype).removeprefix("torch.")
    info["build_s"] = t_build
    info["adapter_source"] = c.adapter_source
    # Copy time per adapter copy of the trace runs, median per rank: measured H2D on CUDA (q, k,
    # v, o of every layer, pinned, side stream), the emulated sleep on a CPU job.
    by_r: dict = {}
    for p in policies:
        for run in runs[p]:
            for a, t in run.load_times:
                by_r.setdefault(int(ranks[a]), []).append(t)
    info["load_s_by_rank"] = {r: statistics.median(v) for r, v in sorted(by_r.items())}
    info["load_s_measured"] = not emulate
    add_cold_start_metrics(metrics, runs, policies, c.policy, by_r, emulate)
    result.info = info
    if emulate:
        result.emulated.append("adapter H2D copy: loader-thread sleep of load_rho x isolated prefill x bytes_paper(r)/mean "
                               f"(rho={wl.load_rho}, t_prefill={t_prefill * 1e3:.1f} ms), not a device copy")
    if c.plots:
        from impl.caraserve.sim import plot_records

        result.artifacts.append(plot_records(recs, job.out_dir / "latency_cdf.png", f"{system.name} (real, {device})"))
    return result



def add_cold_start_metrics(metrics: dict, runs: dict, policies: list, me: str, load_by_rank: dict,
                           emulated: bool) -> None:
    """The cold-start comparison as the paper states it (v1 Fig. 11 and its
    latency over CACHED), for impl/caraserve/paper.yaml's ``gpu_7b_*`` rows: per interleaved policy
    ``{p}_ttft_over_cached`` / ``{p}_latency_over_cached`` (mean over all rounds' records, minus
    1, as the paper's "+22%"), ``{p}_prefill_iter_mean_s`` (mean prefill iteration wall), and
    ``load_s_r{r}`` (median adapter copy per rank; measured only on a device, else emulated)."""
    def mean(p, key):
        vals = [getattr(r, key) for run in runs[p] for r in run.records]
        return float(np.mean(vals)) if vals else None

    for p in policies:
        walls = [row[1] for run in runs[p] for row in run.prefill_log]
        if walls:
            metrics[f"{p}_prefill_iter_mean_s"] = Metric.scalar(float(np.mean(walls)), "s", "lower")
    if "cached" in policies:
        for key, name in (("ttft_s", "ttft"), ("latency_s", "latency")):
            ref = mean("cached", key)
            for p in policies:
                v = mean(p, key)
                if p != "cached" and ref and v is not None:
                    metrics[f"{p}_{name}_over_cached"] = Metric.scalar(v / ref - 1.0, "fraction", "lower")
    if not emulated:
        for r, v in sorted(load_by_rank.items()):
            metrics[f"load_s_r{r}"] = Metric.scalar(statistics.median(v), "s", "lower")
