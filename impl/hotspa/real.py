"""HotSPa real mode (the real CPU experiment, impl/hotspa/README.md "Real mode"): W ranks, one
per GPU over NCCL when the job's execution decision gives every rank a GPU, else CPU processes
over gloo (there: 2, the tiny varlen decoder, fp32); the same rank code either way. The compute
models run in the job's dtype (``execution.dtype`` over ``workload.dtype``), the master weights
and Adam in fp32.

Policies (``system.policy``, or several with ``system.real.interleave``):
- ``hotspa``: the system's group plan (``grouping: explicit``; the real CPU experiment: ``boundaries
  [2048, 1024, 0]``, strategies ``[[1,2,1], [2,1,1]]``: sequences <= 1024 under DP2, 1024-2048
  under TP2 = home), hot switching inside the step (:mod:`impl.hotspa.rank_trainer`).
- ``hotspa_static`` / ``megatron_static``: the home strategy for every sequence (one group up to
  the top boundary), same engine and packing rule: the static TP2 baseline of the real CPU experiment (in real
  mode the two names run the same thing).
Interleaved policies train their own copy of the model from the same initialisation on the
same mini-batches, one step each per round (the order rotates every round). Timing: the step
between two barriers, max over ranks; the first ``workload.warmup_steps`` rounds (which build
the switch plans) are not timed. Per-strategy cost: every non-empty micro-batch's
forward+backward is timed and ``a·s²+b·s+c`` fitted (:func:`fit_seq_cost`); a fit below the R²
floor is reported as refused in ``info.cost_fit``.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from impl.common.api import ConfigError, JobContext, Metric, RunResult
from impl.common.cost.seqlen import fit_seq_cost
from impl.common.models.reference import AdamReference, max_rel_err, record_reference_checks
from impl.common.models.varlen_gpt import VarlenGPT, validate_varlen_shape
from impl.common.parallel.tensor_parallel import check_tp_shape, join_state_dicts
from impl.common.runtime.launch import launch
from impl.common.runtime.rank_device import Intervals, peak_memory_bytes, reset_peak_memory
from impl.common.varlen.lengths import LengthDist
from impl.common.varlen.packing import hotspa_pack
from impl.common.varlen.sampling import LengthStream
from impl.common.workloads.pipeline import ModelShape

from impl.hotspa.policies import POLICIES, in_mode
from impl.hotspa.rank_trainer import RankTrainer, StepLog, plan_step
from impl.hotspa.strategy import GroupPlan, Strategy, make_group_plan
from impl.hotspa.switching import Layouts, SwitchCache
from impl.common.execution import set_torch_threads



def model_shape(model) -> ModelShape:
    return ModelShape(name=model.name, num_layers=model.num_layers, hidden=model.hidden, heads=model.heads,
                      ffn_mult=model.ffn_mult, ffn_hidden=model.ffn_hidden, vocab=model.vocab, seq_len=model.seq_len)


def capacity(s: Strategy, tokens_per_tp: int) -> int:
    return tokens_per_tp * s.tp * s.pp


def policies(system) -> list[str]:
    return list(system.cfg.real.interleave) or [system.cfg.policy]


def policy_plan(system, policy: str, num_gpus: int) -> GroupPlan:
    c = system.cfg
    plan = make_group_plan(c.boundaries, c.strategies, num_gpus)
    if POLICIES.get(policy).real_home_only:
        return GroupPlan((plan.boundaries[0], 0), (plan.home,))
    return plan


def check_real(system, wl, hardware) -> None:
    """Real-mode limits, one line each naming the field and the numbers."""
    c, rk = system.cfg, system.cfg.real
    if c.grouping != "explicit":
        raise ConfigError(f"system.grouping: real mode runs explicit boundaries and strategies (c1/c2/planned are "
                          f"the paper-scale presets of sim mode), got {c.grouping!r}")
    for p in policies(system):
        if p not in in_mode("real"):
            raise ConfigError(f"system.real.interleave: policy {p!r} has no real mode (one of: {', '.join(in_mode('real'))})")
    if wl.dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"workload.dtype: real mode computes in fp32, bf16 or fp16, got {wl.dtype!r}")
    if wl.optimizer != "adam":
        raise ConfigError(f"workload.optimizer: real mode steps Adam in the home layout, got {wl.optimizer!r}")
    if wl.global_batch_seqs < 1:
        raise ConfigError(f"workload.global_batch_seqs: real mode draws steps by sequence count, got {wl.global_batch_seqs}")
    if rk.tokens_per_tp < 1 or rk.check_steps < 0:
        raise ConfigError(f"system.real: tokens_per_tp ({rk.tokens_per_tp}) must be >= 1 and check_steps "
                          f"({rk.check_steps}) >= 0")
    shape = model_shape(wl.model)
    validate_varlen_shape(shape)
    plan = make_group_plan(c.boundaries, c.strategies, wl.num_gpus)
    caps = [capacity(s, rk.tokens_per_tp) for s in plan.strategies]
    if wl.context > max(caps):
        i = caps.index(max(caps))
        raise ConfigError(f"workload.context: sequences of up to {wl.context} tokens exceed every strategy's capacity "
                          f"(largest: {max(caps)} tokens, strategy {plan.strategies[i]} = system.real.tokens_per_tp "
                          f"{rk.tokens_per_tp} x tp x pp)")
    if plan.boundaries[0] < wl.context:
        raise ConfigError(f"system.boundaries: the top boundary {plan.boundaries[0]} is below workload.context "
                          f"{wl.context} (every sequence must fall in a group)")
    for g, (s, cap) in enumerate(zip(plan.strategies, caps)):
        if s.pp != 1 or (s.dp > 1 and s.tp > 1):
            raise ConfigError(f"system.strategies[{g}]: real mode runs (dp,1,1) or (1,tp,1) strategies, got {s}")
        if cap < plan.boundaries[g]:
            raise ConfigError(f"system.strategies[{g}]: {s} holds {cap} tokens per micro-batch (system.real.tokens_per_tp "
                              f"{rk.tokens_per_tp} x tp {s.tp} x pp {s.pp}) < its group's bound {plan.boundaries[g]}")
        if plan.boundaries[g] % c.align:
            raise ConfigError(f"system.align: group bound {plan.boundaries[g]} is not a multiple of align {c.align}")
        check_tp_shape(shape, s.tp, field=f"system.strategies[{g}]")
    check_tp_shape(shape, wl.num_gpus, field="workload.num_gpus (home layout shards)")


@dataclass(frozen=True)
class HotSPaRealJob:
    shape: ModelShape
    seed: int
    num_gpus: int
    gpus_per_node: int
    policies: tuple[str, ...]
    plans: tuple[GroupPlan, ...]
    pad: str
    align: int
    lr: float
    lengths: LengthDist
    seqs_per_step: int
    rounds: int
    check_steps: int  # -1: no checks; 0: every step; k: the first k
    threads: int
    switch_policy: str = "bandwidth_greedy"
    dtype: str = "fp32"  # the compute models' (the job's execution decision over workload.dtype)


def _gather(d: dict) -> dict:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, d)
    return join_state_dicts(out)


def _rank_main(ctx, job: HotSPaRealJob) -> dict:
    set_torch_threads(job.threads)
    rank, W = ctx.rank, ctx.world_size
    layouts = Layouts(W, job.gpus_per_node, job.shape.num_layers)
    shapes = {n: tuple(p.shape) for n, p in VarlenGPT(job.shape, job.seed).named_parameters()}
    cache = SwitchCache(layouts, rank, shapes, job.switch_policy)  # shared: the policies' switches are the same plans
    engines = {p: RankTrainer(job.shape, job.seed, rank, W, plan, job.lr, cache, job.seed, ctx.device, job.dtype)
               for p, plan in zip(job.policies, job.plans)}
    refs = {p: AdamReference(job.shape, job.seed, job.lr) for p in job.policies} if rank == 0 and job.check_steps >= 0 else {}
    stream = LengthStream(job.lengths, job.seed)
    logs: dict[str, list] = {p: [] for p in job.policies}
    checks: list[dict] = []
    for r in range(job.rounds):
        batch = stream.by_count(job.seqs_per_step)
        k = r % len(job.policies)
        for pol, plan in zip(job.policies[k:] + job.policies[:k], job.plans[k:] + job.plans[:k]):
            eng = engines[pol]
            check = job.check_steps == 0 or r < job.check_steps
            bp = plan_step(batch.ids, batch.lengths, plan, job.pad, job.align)
            before = _gather(eng.home_state()) if check else None
            log = StepLog(spans=Intervals(ctx.device))
            reset_peak_memory(ctx.device)
            dist.barrier()
            whole = Intervals(ctx.device)
            i = whole.begin()
            eng.step(bp, log, keep_grads=check)
            whole.end(i)
            dist.barrier()
            log.step_s = whole.seconds()[0]
            log.resolve()
            logs[pol].append({"round": r, "step_s": log.step_s, "peak_memory_bytes": peak_memory_bytes(ctx.device), "switch_s": log.switch_s, "loss_part": log.loss_part,
                              "switches": log.switches, "switch_bytes": log.switch_bytes,
                              "groups_run": log.groups_run, "micro_batches": log.micro_batches,
                              "num_micro_batches": [sum(1 for rr in ranks for mb in rr if not mb.is_empty)
                                                    for _, _, ranks in bp.groups]})
            if check:
                grads, after = _gather(eng.last_grads), _gather(eng.home_state())
                if rank == 0:
                    mbs = hotspa_pack(batch.ids, batch.lengths, job.plans[0].boundaries[0], pad="none")
                    loss, rg, rp = refs[pol].step(before, mbs, sum(mb.num_tokens for mb in mbs), job.seed, grads)
                    checks.append({"round": r, "policy": pol, "ref_loss": loss, "grad_err": max_rel_err(grads, rg),
                                   "param_err": max_rel_err(after, rp)})
    final = {p: _gather(e.home_state()) for p, e in engines.items()}
    return {"device": str(ctx.device), "backend": ctx.backend, "logs": logs, "checks": checks, "optimizer_steps": {p: e.optimizer_steps for p, e in engines.items()},
            "switches_built": cache.built, "final": final if rank == 0 else None,
            "switch_summaries": cache.summaries()}


def _fit(samples: list, field: str) -> dict:
    if not samples:
        return {"samples": 0}
    try:
        c = fit_seq_cost([s[1] for s in samples], [s[3] for s in samples], sq_lengths=[s[2] for s in samples],
                         field=field)
        return {"a": c.a, "b": c.b, "c": c.c, "r2": c.r2, "samples": len(samples)}
    except ConfigError as e:
        return {"refused": str(e), "samples": len(samples)}


def summarise(results: list, job: HotSPaRealJob, warmup: int, main: str, rtol: float) -> RunResult:
    W = len(results)
    on_gpu = results[0]["device"].startswith("cuda")
    res = RunResult(metrics={}, emulated=[] if on_gpu else
                    [f"GPUs: CPU processes over {results[0]['backend']}, {job.dtype}, {job.threads} thread(s) each"])
    per: dict[str, dict] = {}
    for pol in job.policies:
        steps = []
        for i in range(job.rounds):
            rows = [results[r]["logs"][pol][i] for r in range(W)]
            steps.append({"round": i, "step_s": max(x["step_s"] for x in rows),
                          "switch_s": max(x["switch_s"] for x in rows),
                          "loss": sum(x["loss_part"] for x in rows), "switches": rows[0]["switches"],
                          "switch_bytes": [x["switch_bytes"] for x in rows], "groups_run": rows[0]["groups_run"],
                          "num_micro_batches": rows[0]["num_micro_batches"]})
        per[pol] = {"steps": steps, "timed": [s for s in steps if s["round"] >= warmup]}
    m = res.metrics
    for pol, d in per.items():
        m[f"step_time_s__{pol}"] = Metric.from_samples([s["step_s"] for s in d["timed"]], "s", "lower")
        m[f"switch_time_s__{pol}"] = Metric.from_samples([s["switch_s"] for s in d["timed"]], "s", "lower")
    med = {pol: statistics.median(s["step_s"] for s in d["timed"]) for pol, d in per.items()}
    m["step_time_s"] = m[f"step_time_s__{main}"]
    peaks = [max((row.get("peak_memory_bytes") or 0) for row in r["logs"][main]) for r in results]
    if on_gpu:  # torch.cuda.max_memory_allocated per rank over the main policy's steps
        m["peak_memory_bytes"] = Metric.scalar(float(max(peaks)), "bytes", "lower")
    m["switch_time_s"] = m[f"switch_time_s__{main}"]
    m["switch_frac"] = Metric.scalar(statistics.median(s["switch_s"] for s in per[main]["timed"]) / med[main],
                                     "fraction", "lower")
    others = [p for p in job.policies if p != main]
    for pol in others:
        m[f"speedup_vs_{pol}"] = Metric.scalar(med[pol] / med[main], "x", "higher")
    static = next((p for p in job.policies if POLICIES.get(p).real_home_only and p != main), None)
    if static is not None:
        m["speedup_vs_static"] = Metric.scalar(med[static] / med[main], "x", "higher")
    checks = results[0]["checks"]
    record_reference_checks(res, checks, lambda c: per[c["policy"]]["steps"][c["round"]]["loss"], rtol)
    for r in results:
        for pol, n in r["optimizer_steps"].items():
            if n != job.rounds:
                res.mark_invalid(f"{pol}: {n} optimizer steps in {job.rounds} steps (must be exactly one per step)")
    final = results[0]["final"]
    cross = {f"{a}_vs_{b}": max_rel_err(final[a], final[b]) for a in job.policies for b in job.policies if a < b}
    # per-strategy cost fit from the timed rounds (TP micro-batches once, from TP rank 0)
    samples: dict[str, list] = {}
    for r in results:
        for pol in job.policies:
            for row in r["logs"][pol]:
                if row["round"] >= warmup:
                    for s in row["micro_batches"]:
                        if s[4] == 0:
                            samples.setdefault(s[0], []).append(s)
    fits = {lay: _fit(ss, f"cost fit {lay}") for lay, ss in samples.items()}
    res.info = {"policies": list(job.policies), "main": main, "dtype": job.dtype,
                "rank_devices": [r["device"] for r in results],
                "peak_memory_bytes_per_rank": peaks if on_gpu else None, "median_step_s": med,
                "steps": {p: d["steps"] for p, d in per.items()}, "checks": checks,
                "param_rel_err_between_policies": cross, "cost_fit": fits,
                "switches_built": results[0]["switches_built"], "switch_plans": results[0]["switch_summaries"],
                "optimizer_steps": results[0]["optimizer_steps"]}
    if len(per[main]["timed"]) < 3:
        res.mark_invalid(f"only {len(per[main]['timed'])} timed steps (need >= 3)")
    return res


def make_job(system, wl, seed: int, dtype: str = "fp32") -> HotSPaRealJob:
    rk = system.cfg.real
    pols = tuple(policies(system))
    rounds = wl.warmup_steps + wl.steps
    return HotSPaRealJob(model_shape(wl.model), seed, wl.num_gpus, wl.gpus_per_node, pols,
                   tuple(policy_plan(system, p, wl.num_gpus) for p in pols), system.cfg.pad, system.cfg.align,
                   wl.lr, wl.lengths, wl.global_batch_seqs, rounds,
                   (rk.check_steps if rk.check_grads else -1), wl.torch_threads, system.cfg.switch_policy, dtype)


def run_job(job: HotSPaRealJob, timeout_s: float) -> list:
    # backend None: the job's execution decision (nccl when every rank gets a GPU, else gloo)
    return launch(_rank_main, job.num_gpus, (job,), label="hotspa real", backend=None, timeout_s=timeout_s).results


def run_real(system, job: JobContext) -> RunResult:
    wl = job.workload
    rj = make_job(system, wl, job.seed, job.execution.dtype_name(wl.dtype))
    results = run_job(rj, system.cfg.real.timeout_s)
    main = system.cfg.policy if system.cfg.policy in rj.policies else rj.policies[0]
    return summarise(results, rj, wl.warmup_steps, main, system.cfg.real.grad_rtol)
