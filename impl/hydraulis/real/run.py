"""Hydraulis real mode (the CPU experiment, README "Real mode"): W gloo ranks (2 there), 1 thread
each, the tiny varlen decoder in fp32, G tokens per step.

One job runs every configured run (``system.real.runs``; the CPU experiment's: B0 = A+A greedy packing with
equal micro-batch counts, B1 = A+A two-stage, H = A+B two-stage) interleaved: each round draws
one batch and runs one step of every run on it, the order rotating every round; each run
trains its own copy of the model from the same initialisation. Per job:
Batches: :func:`impl.hydraulis.batches.step_batches` (Σ = G exactly, as in sim).
1. Profile: every replica kind used is timed on micro-batches of 64…2048 tokens on every rank
   and (a, b, c) fitted (:mod:`impl.hydraulis.real.fit`), before any training step; the
   planner prices with these fits.
2. Per round and run: rank 0 plans (:mod:`impl.hydraulis.real.plan`; with
   ``system.real.plan_ahead`` the plans of round t+1 are computed in a thread while round t
   trains, and the time a step still waits for its plan is added to its step time) and
   broadcasts the plan; then the step of :mod:`impl.hydraulis.disagg`: all-gather the master
   shards, compute copies per replica, forward+backward of each replica's micro-batches (loss
   / the step's global token count), gradients back to the optimizer layout summed over
   replicas, one Adam step.
3. Timing: between two barriers, max over ranks; the first ``workload.warmup_steps`` rounds
   are not in the metrics. The checked steps (``system.real.check_steps``) compare the loss,
   every gradient and the parameters after Adam with a single-process model on the same batch
   (outside the timed window).
Predicted vs measured: the planner's compute prediction against the measured compute makespan
(max over ranks of forward+backward), and a step prediction = compute prediction + the
gather/reduce/optimizer overhead measured in the warm-up rounds, against the step time.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from impl.common.api import ConfigError, JobContext, Metric, RunResult
from impl.common.models.reference import AdamReference, max_rel_err, record_reference_checks
from impl.common.models.varlen_gpt import VarlenGPT, micro_batch_tensors, validate_varlen_shape
from impl.common.parallel.tensor_parallel import check_tp_shape, join_state_dicts
from impl.common.runtime.launch import launch
from impl.common.varlen.packing import greedy_pack
from impl.common.workloads.pipeline import ModelShape

from impl.hydraulis.batches import check_budget, step_batches
from impl.hydraulis.cost.strategy import ReplicaCost
from impl.hydraulis.disagg import OptimizerLayout, Strategy, compute_copy
from impl.hydraulis.dispatch import DEFAULT_BUDGET
from impl.hydraulis.policies import in_mode
from impl.hydraulis.real.config import HydraulisRealKnobs, RealRun, ReplicaKind
from impl.hydraulis.real.fit import fit_kind, fit_rows, profile, row_medians
from impl.hydraulis.real.plan import PlanAhead, Planner, RunPlan, check_run
from impl.hydraulis.real.replica import ReplicaModel
from impl.common.execution import set_torch_threads



def model_shape(model) -> ModelShape:
    return ModelShape(name=model.name, num_layers=model.num_layers, hidden=model.hidden, heads=model.heads,
                      ffn_mult=model.ffn_mult, ffn_hidden=model.ffn_hidden, vocab=model.vocab, seq_len=model.seq_len)


def _planner_knobs(system) -> dict:
    """The planner knobs real mode shares with sim (top-level ``system.*``)."""
    c = system.cfg
    return {"shuffles": int(c.shuffles), "v_window": int(c.v_window), "time_limit_s": float(c.ilp_time_limit_s),
            "mip_rel_gap": float(c.mip_rel_gap), "includes_c": bool(c.dispatch_includes_c),
            "refine": bool(c.dispatch_refine), "budget": int(c.dispatch_budget)}


def job_runs(system) -> list[RealRun]:
    """``system.real.runs``, or the policy's own run alone."""
    rk = system.cfg.real
    if rk.runs:
        return list(rk.runs)
    p = system.component
    return [RealRun(p.name, p.batching, [list(c) for c in p.pool])]


def check_real(system, wl, hardware) -> None:
    """Real-mode limits, one line each naming the field and the numbers."""
    rk: HydraulisRealKnobs = system.cfg.real
    if "real" not in system.component.modes:
        raise ConfigError(f"system.policy: {system.cfg.policy!r} has no real mode (one of: {', '.join(in_mode('real'))})")
    if wl.dtype != "fp32":
        raise ConfigError(f"workload.dtype: real mode trains fp32 on CPU, got {wl.dtype!r}")
    if wl.optimizer != "adam":
        raise ConfigError(f"workload.optimizer: real mode steps Adam in the optimizer layout, got {wl.optimizer!r}")
    check_budget(wl)
    if wl.lengths.max_len > wl.context or wl.lengths.max_len == 0:
        raise ConfigError(f"workload.lengths.max_len: {wl.lengths.max_len} must be in [1, workload.context "
                          f"{wl.context}] (0 = unbounded)")
    shape = model_shape(wl.model)
    validate_varlen_shape(shape)
    check_tp_shape(shape, wl.num_gpus, field="workload.num_gpus (optimizer-layout shards)")
    names = [k.name for k in rk.kinds]
    if len(set(names)) != len(names):
        raise ConfigError(f"system.real.kinds: names repeat: {names}")
    kinds = {k.name: k for k in rk.kinds}
    for k in rk.kinds:
        f = f"system.real.kinds[{k.name}]"
        if k.cap < 1 or k.util < 1:
            raise ConfigError(f"{f}: cap ({k.cap}) and util ({k.util}) must be >= 1")
        if k.tp not in (1, wl.num_gpus):
            raise ConfigError(f"{f}.tp: real mode runs tp 1 or tp = workload.num_gpus {wl.num_gpus}, got {k.tp}")
        distinct = {s for s in rk.fit_lengths if 1 <= s <= k.cap}
        if len(distinct) < 3:
            raise ConfigError(f"system.real.fit_lengths: kind {k.name!r} (cap {k.cap}) gets {len(distinct)} distinct "
                              f"lengths <= its cap, the fit needs >= 3")
    runs = job_runs(system)
    rnames = [r.name for r in runs]
    if len(set(rnames)) != len(rnames):
        raise ConfigError(f"system.real.runs: names repeat: {rnames}")
    for r in runs:
        check_run(r, kinds, wl.num_gpus, wl.context, f"system.real.runs[{r.name}]")
    if rk.fit_repeats < 1 or rk.check_steps < -1:
        raise ConfigError(f"system.real: fit_repeats ({rk.fit_repeats}) must be >= 1 and check_steps "
                          f"({rk.check_steps}) >= -1")
    if any(len(p) != 2 or p[0] < 1 or p[1] < 1 for p in rk.pack_rows):
        raise ConfigError(f"system.real.pack_rows: each row is [count >= 1, length >= 1], got {rk.pack_rows}")


@dataclass(frozen=True)
class HydraulisRealJob:
    shape: ModelShape
    seed: int
    world: int
    kinds: tuple[ReplicaKind, ...]
    runs: tuple[RealRun, ...]
    knobs: HydraulisRealKnobs
    lr: float
    batches: tuple  # StepBatch per round, the same for every run (impl.hydraulis.batches)
    rounds: int
    warmup: int
    threads: int
    shuffles: int = 100
    v_window: int = 16
    time_limit_s: float = 0.5
    mip_rel_gap: float = 0.0
    includes_c: bool = True
    refine: bool = True
    budget: int = DEFAULT_BUDGET

    def used_kinds(self) -> list[ReplicaKind]:
        used = {k for r in self.runs for c in r.candidates for k in c}
        return [k for k in self.kinds if k.name in used]

    def checked(self, rnd: int) -> bool:
        c = self.knobs.check_steps
        return c == 0 or (c > 0 and rnd < c)


def _gather_objects(obj) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _cpu(d: dict) -> dict:
    """CPU copies for the single-process reference (rank 0 checks on the CPU)."""
    return {n: t.to("cpu") for n, t in d.items()}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bcast(obj, rank: int):
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _profile(job: HydraulisRealJob, models: dict, full: dict, rank: int) -> dict:
    for kind in job.used_kinds():
        models[kind.name].load(compute_copy(full, Strategy((kind.tp,) * (job.world // kind.tp)), rank))
    return profile(models, {k.name: fit_rows(k, job.knobs) for k in job.used_kinds()}, job.knobs.fit_repeats)


def _fit_costs(job: HydraulisRealJob, per_rank: list) -> tuple[dict, dict]:
    costs, info = {}, {}
    for kind in job.used_kinds():
        # a TP kind's rows run on every rank together: one sample per row (rank 0's clock)
        ss = per_rank[0][kind.name] if kind.tp > 1 else [s for r in per_rank for s in r[kind.name]]
        fit = fit_kind(kind, ss, job.knobs.fit_min_r2)
        costs[kind.name] = ReplicaCost.from_seq_cost(kind.tp, 1, fit, kind.cap, kind.util)
        info[kind.name] = {"a_ms": costs[kind.name].a, "b_ms": costs[kind.name].b, "c_ms": costs[kind.name].c,
                           "r2": fit.r2, "samples": len(ss), "points": [list(p) for p in row_medians(ss)], "checkpoint": kind.checkpoint, "cap": kind.cap,
                           "tp": kind.tp}
    return costs, info


def _rank_main(ctx, job: HydraulisRealJob) -> dict:
    set_torch_threads(job.threads)
    rank, W = ctx.rank, ctx.world_size
    dev = ctx.device  # cuda:<local rank> under NCCL, else the CPU
    with torch.device(dev):
        full0 = {n: p.detach().clone() for n, p in VarlenGPT(job.shape, job.seed).named_parameters()}
    layouts = {r.name: OptimizerLayout(full0, rank, W, job.lr) for r in job.runs}
    models = {k.name: ReplicaModel(job.shape, job.seed, k, tp_rank=rank if k.tp > 1 else 0, device=dev)
              for k in job.used_kinds()}
    kinds = {k.name: k for k in job.kinds}
    t0 = time.perf_counter()
    per_rank = _gather_objects(_profile(job, models, full0, rank))
    profile_s = time.perf_counter() - t0
    ahead = None
    fit_info = None
    if rank == 0:
        costs, fit_info = _fit_costs(job, per_rank)
        ahead = PlanAhead(Planner(costs, shuffles=job.shuffles, v_window=job.v_window, time_limit_s=job.time_limit_s,
                                  mip_rel_gap=job.mip_rel_gap, includes_c=job.includes_c, seed=job.seed,
                                  refine=job.refine, budget=job.budget),
                          job.knobs.plan_ahead)
        batches = list(job.batches)
    refs = {r.name: AdamReference(job.shape, job.seed, job.lr) for r in job.runs} if rank == 0 and job.knobs.check_steps >= 0 else {}
    logs: dict[str, list] = {r.name: [] for r in job.runs}
    checks: list[dict] = []
    try:
        for rnd in range(job.rounds):
            if rank == 0:
                if rnd == 0:
                    for run in job.runs:
                        ahead.submit(run, 0, batches[0].ids, batches[0].lengths)
                if rnd + 1 < job.rounds:  # plan round t+1 while round t trains
                    for run in job.runs:
                        ahead.submit(run, rnd + 1, batches[rnd + 1].ids, batches[rnd + 1].lengths)
            k = rnd % len(job.runs)
            for run in job.runs[k:] + job.runs[:k]:
                plan, wait_s = ahead.get(run, rnd, batches[rnd].ids, batches[rnd].lengths) if rank == 0 else (None, 0.0)
                plan: RunPlan = _bcast(plan, rank)
                logs[run.name].append(_step(job, run, plan, layouts[run.name], models, kinds, rank, wait_s,
                                            refs.get(run.name), checks, batches[rnd] if rank == 0 else None))
    finally:
        if ahead is not None:
            ahead.close()
    return {"device": str(dev), "backend": ctx.backend, "logs": logs, "checks": checks, "fit": fit_info,
            "profile_s": profile_s,
            "optimizer_steps": {n: l.steps for n, l in layouts.items()},
            "tokens": [int(b.num_tokens) for b in batches] if rank == 0 else None}


def _step(job: HydraulisRealJob, run: RealRun, plan: RunPlan, layout: OptimizerLayout, models: dict, kinds: dict,
          rank: int, wait_s: float, ref: Optional[Reference], checks: list, batch) -> dict:
    strategy = Strategy(tuple(kinds[k].tp for k in plan.kinds))
    r, _ = strategy.place(rank)
    kind = kinds[plan.kinds[r]]
    model = models[kind.name]
    mbs = plan.micro_batches[r]
    tensors = [micro_batch_tensors(mb, job.shape.vocab, job.seed) for mb in mbs]  # data loading: untimed
    global_tokens = sum(mb.num_tokens for m in plan.micro_batches for mb in m)
    check = job.checked(plan.round)
    before = _gather_objects(_cpu(layout.state())) if check else None
    dist.barrier()
    t0 = time.perf_counter()
    full = layout.gather()
    model.load(compute_copy(full, strategy, rank))
    _sync(layout.device)  # the phase boundaries are read on the host clock
    t1 = time.perf_counter()
    run_out = model.run(mbs, global_tokens, f"run {run.name} replica {r}", tensors) if mbs else None
    t2 = time.perf_counter()
    red = layout.reduce(model.grads() if mbs else None, strategy, plan.active)
    _sync(layout.device)
    t3 = time.perf_counter()
    grads = {n: p.grad.to("cpu", copy=True) for n, p in layout.params.items()} if check else None
    layout.step()
    _sync(layout.device)
    t4 = time.perf_counter()
    dist.barrier()
    step_s = time.perf_counter() - t0
    row = {"round": plan.round, "step_s": step_s, "gather_s": t1 - t0, "compute_s": t2 - t1, "reduce_s": t3 - t2,
           "opt_s": t4 - t3, "plan_wait_s": wait_s, "excluded": red.excluded, "sent_bytes": red.sent_bytes,
           "loss_part": (run_out.loss if run_out else 0.0) if strategy.place(rank)[1] == 0 else 0.0,
           "mb_times": run_out.mb_times_s if run_out else [], "kind": kind.name,
           "plan": plan.summary() if rank == 0 else None}
    if check:
        g_all, after = _gather_objects(grads), _gather_objects(_cpu(layout.state()))
        if rank == 0:
            b, g, a = join_state_dicts(before), join_state_dicts(g_all), join_state_dicts(after)
            mbs = greedy_pack(batch.ids, batch.lengths, int(max(batch.lengths)), pad="none")
            loss, rg, rp = ref.step(b, mbs, int(np.sum(batch.lengths)), job.seed, g)
            checks.append({"round": plan.round, "run": run.name, "ref_loss": loss, "grad_err": max_rel_err(g, rg),
                           "param_err": max_rel_err(a, rp)})
    return row


def summarise(results: list, job: HydraulisRealJob, rtol: float) -> RunResult:
    on_gpu = results[0].get("device", "cpu").startswith("cuda")
    where = "" if on_gpu else f"GPUs: CPU processes over {results[0].get('backend', 'gloo')}, fp32, 1 thread each; "
    res = RunResult(metrics={}, emulated=[f"{where}TP/PP memory and speed differences stood in by activation "
                                          "checkpointing and token caps (impl/hydraulis/README.md, 'Real mode')"])
    W = len(results)
    tokens = results[0]["tokens"]
    per: dict[str, list] = {}
    for run in job.runs:
        steps = []
        for i in range(job.rounds):
            rows = [results[r]["logs"][run.name][i] for r in range(W)]
            plan = rows[0]["plan"]
            compute = max(x["compute_s"] for x in rows)
            steps.append({"round": i, "step_s": max(x["step_s"] for x in rows) + rows[0]["plan_wait_s"],
                          "train_s": max(x["step_s"] for x in rows), "compute_s": compute,
                          "compute_s_per_rank": [x["compute_s"] for x in rows],
                          "overhead_s": max(x["step_s"] for x in rows) - compute,
                          "plan_wait_s": rows[0]["plan_wait_s"], "loss": sum(x["loss_part"] for x in rows),
                          "tokens": tokens[i], "replica_tokens": plan["tokens"], "excluded": rows[0]["excluded"],
                          "predicted_compute_s": plan["predicted_ms"] / 1e3, **{k: plan[k] for k in (
                              "candidate", "kinds", "num_micro_batches", "plan_s", "status", "replica_ms")}})
        per[run.name] = steps
    m = res.metrics
    main = job.runs[0].name
    med: dict[str, float] = {}
    for name, steps in per.items():
        warm = [s for s in steps if s["round"] < job.warmup]
        timed = [s for s in steps if s["round"] >= job.warmup]
        if not timed:
            res.mark_invalid(f"run {name}: no timed steps ({job.rounds} rounds, {job.warmup} warm-up)")
            continue
        cal = [s for s in warm if s["round"] >= 1] or warm or timed
        overhead = statistics.median(s["overhead_s"] for s in cal)
        m[f"step_time_s__{name}"] = Metric.from_samples([s["step_s"] for s in timed], "s", "lower")
        m[f"tokens_per_s__{name}"] = Metric.scalar(sum(s["tokens"] for s in timed) / sum(s["step_s"] for s in timed),
                                                   "tokens/s", "higher")
        m[f"plan_time_s__{name}"] = Metric.from_samples([s["plan_s"] for s in timed], "s", "lower")
        m[f"plan_wait_s__{name}"] = Metric.from_samples([s["plan_wait_s"] for s in timed], "s", "lower")
        m[f"pred_err_compute__{name}"] = Metric.from_samples(
            [abs(s["predicted_compute_s"] - s["compute_s"]) / s["compute_s"] for s in timed], "fraction", "lower")
        m[f"pred_err_step__{name}"] = Metric.from_samples(
            [abs(s["predicted_compute_s"] + overhead - s["step_s"]) / s["step_s"] for s in timed], "fraction", "lower")
        med[name] = statistics.median(s["step_s"] for s in timed)
        for s in steps:
            s["predicted_step_s"] = s["predicted_compute_s"] + overhead
    if main in med:
        for key in ("step_time_s", "tokens_per_s", "plan_time_s", "plan_wait_s", "pred_err_compute", "pred_err_step"):
            m[key] = m[f"{key}__{main}"]
        for name in med:
            if name != main:
                m[f"speedup_vs_{name}"] = Metric.scalar(med[name] / med[main], "x", "higher")
    checks = results[0]["checks"]
    record_reference_checks(res, checks, lambda c: per[c["run"]][c["round"]]["loss"], rtol)
    for r in results:
        for name, n in r["optimizer_steps"].items():
            if n != job.rounds:
                res.mark_invalid(f"run {name}: {n} optimizer steps in {job.rounds} steps (must be one per step)")
    res.info = {"runs": [r.name for r in job.runs], "main": main, "median_step_s": med,
                "cost_fit": results[0]["fit"], "profile_s": results[0]["profile_s"], "checks": checks,
                "steps": per, "warmup_rounds": job.warmup, "interleaved": len(job.runs) > 1,
                "candidates_won": {n: _counts(s["candidate"] for s in steps if s["round"] >= job.warmup)
                                   for n, steps in per.items()}}
    return res


def _counts(xs) -> dict:
    out: dict = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


def plain_knobs(rk, runs) -> HydraulisRealKnobs:
    """Plain dataclasses (not config nodes) for the ranks."""
    kinds = [ReplicaKind(str(k.name), bool(k.checkpoint), int(k.cap), int(k.tp), int(k.util)) for k in rk.kinds]
    runs = [RealRun(str(r.name), str(r.batching), [[str(x) for x in c] for c in r.candidates]) for r in runs]
    return HydraulisRealKnobs(kinds=kinds, runs=runs, fit_lengths=[int(x) for x in rk.fit_lengths],
                     pack_rows=[[int(x) for x in p] for p in rk.pack_rows], fit_repeats=int(rk.fit_repeats),
                     fit_min_r2=float(rk.fit_min_r2), plan_ahead=bool(rk.plan_ahead), check_steps=int(rk.check_steps),
                     grad_rtol=float(rk.grad_rtol), timeout_s=float(rk.timeout_s))


def make_job(system, wl, seed: int) -> HydraulisRealJob:
    rk = plain_knobs(system.cfg.real, job_runs(system))
    rounds = wl.warmup_steps + wl.steps
    return HydraulisRealJob(model_shape(wl.model), seed, wl.num_gpus, tuple(rk.kinds), tuple(rk.runs), rk, wl.lr,
                   tuple(step_batches(wl, seed, rounds)), rounds, wl.warmup_steps, wl.torch_threads,
                   **_planner_knobs(system))


def run_job(job: HydraulisRealJob, timeout_s: float) -> list:
    # backend None: the job's execution decision (nccl when every rank gets a GPU, else gloo)
    return launch(_rank_main, job.world, (job,), label="hydraulis real", backend=None, timeout_s=timeout_s).results


def run_real(system, job: JobContext) -> RunResult:
    rj = make_job(system, job.workload, job.seed)
    return summarise(run_job(rj, system.cfg.real.timeout_s), rj, system.cfg.real.grad_rtol)
