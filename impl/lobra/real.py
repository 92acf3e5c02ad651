"""LobRA real mode (the real experiments of impl/lobra/README.md, "Reconstructed choices"): 2 ranks as fine-tuning replicas of one frozen base with one
LoRA adapter per task, through the one launcher (:func:`impl.common.runtime.launch.launch`): one GPU
each over NCCL when the job's execution decision gives every rank a GPU, else CPU processes over
gloo, the same rank code; the base in the job's dtype (``execution.dtype`` over ``workload.dtype``).

Replica kinds (the CPU proxy for TP differences): ``R_L`` = activation checkpointing,
``R_S`` = no checkpointing. Their ``max_tokens``: ``system.real.large_max_tokens`` /
``small_max_tokens`` as given (the first real experiment: 2048 / 512), or with ``memory_budget_bytes`` > 0 the
authors' profile_memory rule on that per-rank budget (:mod:`impl.lobra.real_memory`:
checkpointing holds more tokens in the same bytes). A micro-batch holds up to
``max_tokens // s`` sequences of bucket s.

1. Profile: rank 0 times R_L micro-batches and rank 1 R_S ones (concurrently, 1 thread each) on
   the ``profile_mbs`` x ``profile_lengths`` grid (mbs·s <= max_tokens); rank 0 fits the authors' cost form
   f(mbs, s) per kind (:func:`impl.lobra.cost.replica.fit_tp_cost`, R² kept). A refused fit is recorded
   and that kind's deployment dispatches length-based (GROUP) instead of the ILP.
2. Per round, every policy runs one joint step on the same sampled batch (order rotated):
   - ``lobra``: rank 0 = R_L, rank 1 = R_S; dynamic buckets (DP, ``num_buckets``); the balanced
     dispatch ILP (``dispatch=length`` gives GROUP) assigns sequences by bucket;
   - ``task_fused``: R_L + R_L, ``fixed_buckets``, even split;
   - ``task_sequential``: one sub-step per task (its batch alone, its adapter's all-reduce and
     Adam step), both replicas R_S if the task's maximum <= R_S's max_tokens, else R_L.
   Rank 0 plans (bucketing + dispatch, timed: planner time) and broadcasts the micro-batches.
   Each replica runs its micro-batches (loss of task t normalised by t's global token count),
   all-reduces the adapter gradients, and steps Adam on the adapters. A step is timed barrier to
   barrier: CPU-seconds = 2 x makespan (summed over sub-steps for Task-Sequential).
3. Checks: on the first ``check_steps`` rounds rank 0 recomputes the step's adapter gradients in
   one process (every sequence its own micro-batch, same adapter state) and compares them with
   the all-reduced ones; every rank checks its base weights are bit-identical at the end.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from impl.common.api import ConfigError, JobContext, Metric, RunResult
from impl.common.llm.lora_train import MultiTaskLoRA, Sample, task_token_counts
from impl.common.runtime.launch import launch
from impl.common.runtime.rank_device import peak_memory_bytes, torch_dtype

from impl.lobra.cost.replica import Scheme, TpCost, fit_tp_cost, replica_time
from impl.lobra.dispatch import ReplicaGroup
from impl.lobra.joint_step import TaskStreams, plan_bucketed
from impl.common.execution import set_torch_threads
from impl.common.registry import Registry

KINDS = ("R_L", "R_S")
PROFILE_TASK_ID0 = 1 << 40  # profile sequences' ids: far from any task stream's


def policies(system) -> list[str]:
    return list(system.cfg.real.interleave) or [system.cfg.policy]


def max_tokens_of(system, wl) -> dict[str, int]:
    """Each kind's cap: ``large/small_max_tokens`` as given, or, with ``memory_budget_bytes`` > 0,
    the profiling rule on that per-rank budget (:mod:`impl.lobra.real_memory`)."""
    rk = system.cfg.real
    if rk.memory_budget_bytes <= 0:
        return {"R_L": int(rk.large_max_tokens), "R_S": int(rk.small_max_tokens)}
    from impl.lobra.real_memory import caps_from_budget, profile_memory

    mem = profile_memory(wl.model, len(wl.tasks), wl.lora_rank, tuple(rk.memory_profile_lengths))
    return caps_from_budget(mem, rk.memory_budget_bytes)


def memory_rule_info(system, wl) -> dict:
    rk = system.cfg.real
    if rk.memory_budget_bytes <= 0:
        return {"rule": "given (system.real.large_max_tokens / small_max_tokens)"}
    from impl.lobra.real_memory import profile_memory

    mem = profile_memory(wl.model, len(wl.tasks), wl.lora_rank, tuple(rk.memory_profile_lengths))
    return {"rule": "profile_memory on a per-rank budget", "budget_bytes": rk.memory_budget_bytes,
            "peak_bytes": {k: {str(s): b for s, b in km.peak_bytes.items()} for k, km in mem.items()},
            "states_bytes": {k: km.states_bytes for k, km in mem.items()}, "caps": max_tokens_of(system, wl)}


def check_real(system, wl, hardware) -> None:
    """Real-mode limits, one line each naming the field and the numbers."""
    c, rk = system.cfg, system.cfg.real
    if rk.memory_budget_bytes > 0 and (not rk.memory_profile_lengths or min(rk.memory_profile_lengths) < 1):
        raise ConfigError(f"system.real.memory_profile_lengths: need lengths >= 1, got {list(rk.memory_profile_lengths)}")
    caps = max_tokens_of(system, wl)
    if wl.num_gpus != 2:
        raise ConfigError(f"workload.num_gpus: real mode runs 2 replicas (R_L + R_S), got {wl.num_gpus}")
    if wl.dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"workload.dtype: real mode runs the base in fp32, bf16 or fp16, got {wl.dtype!r}")
    if not 1 <= caps["R_S"] <= caps["R_L"]:
        raise ConfigError(f"system.real: need 1 <= small_max_tokens ({caps['R_S']}) <= large_max_tokens "
                          f"({caps['R_L']})")
    top = wl.max_len
    if top > caps["R_L"]:
        t = max(wl.tasks, key=lambda t: t.lengths.max_len)
        raise ConfigError(f"workload.tasks: the longest sequence {top} (task {t.name!r}) is beyond every replica's "
                          f"max_tokens (R_L {caps['R_L']}, R_S {caps['R_S']})")
    pols = policies(system)
    if any(p != "lobra" for p in pols) or c.bucketing == "fixed":
        if c.fixed_buckets[-1] < top:
            raise ConfigError(f"system.fixed_buckets: largest {c.fixed_buckets[-1]} is below the longest sequence {top}")
        if c.fixed_buckets[-1] > caps["R_L"]:
            raise ConfigError(f"system.fixed_buckets: largest {c.fixed_buckets[-1]} is beyond R_L's max_tokens "
                              f"{caps['R_L']}")
    if min(rk.profile_mbs, default=0) < 1 or min(rk.profile_lengths, default=0) < 1 or rk.profile_reps < 1:
        raise ConfigError(f"system.real: profile_mbs {list(rk.profile_mbs)}, profile_lengths "
                          f"{list(rk.profile_lengths)} and profile_reps {rk.profile_reps} must be non-empty and >= 1")


@dataclass(frozen=True)
class LobRARealJob:
    shape: object  # the base's ModelShape
    tasks: tuple  # TaskSpec per task
    seed: int
    policies: tuple[str, ...]
    max_tokens: dict  # kind -> max_tokens
    num_buckets: int
    fixed_buckets: tuple[int, ...]
    bucket_cuts: str
    dispatch: str
    exec_mode: str
    ilp_time_limit_s: float
    ilp_gap: float
    profile_mbs: tuple[int, ...]
    profile_lengths: tuple[int, ...]
    profile_reps: int
    rounds: int
    check_steps: int
    init_b_zero: bool
    rank: int
    alpha: float
    lr: float
    threads: int
    dtype: str = "fp32"  # the frozen base's

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]


# ---- rank side --------------------------------------------------------------------------------
def profile_grid(job: LobRARealJob, kind: str) -> list[tuple[int, int]]:
    m = job.max_tokens[kind]
    return [(b, s) for s in sorted(set(job.profile_lengths)) if s <= m
            for b in sorted(set(job.profile_mbs)) if b * s <= m]


def profile(model: MultiTaskLoRA, job: LobRARealJob, kind: str) -> list[tuple[int, int, float]]:
    """``(mbs, s, seconds per layer)`` per grid point: the fastest of ``profile_reps`` timed
    forward+backward passes of one full-length micro-batch (one untimed warm-up first)."""
    model.set_checkpoint(kind == "R_L")
    t0 = job.task_names[0]
    ids = iter(range(PROFILE_TASK_ID0, PROFILE_TASK_ID0 + 10 ** 6))

    def run(b: int, s: int) -> float:
        batch = [Sample(t0, next(ids), s) for _ in range(b)]
        model.zero_grad()
        a = time.perf_counter()
        model.micro_batch(batch, s, {t0: b * s}, mode="fused")
        return time.perf_counter() - a

    grid = profile_grid(job, kind)
    run(*grid[0])
    out = [(b, s, min(run(b, s) for _ in range(job.profile_reps)) / job.shape.num_layers) for b, s in grid]
    model.zero_grad()
    return out


def fit_kind(samples, kind: str) -> dict:
    try:
        c = fit_tp_cost(samples, field=f"system.real cost fit {kind}")
        return {"c": list(c.c), "r2": c.r2, "samples": len(samples)}
    except ConfigError as e:
        return {"refused": str(e), "samples": len(samples)}


def schemes_of(job: LobRARealJob, fits: dict) -> dict[str, Scheme]:
    out = {}
    for k in KINDS:
        f = fits[k]
        cost = TpCost(tuple(f["c"]), r2=f["r2"], source="fit") if "c" in f else TpCost((0, 0, 0, 1e-9, 0, 0),
                                                                                        r2=0.0, source="refused")
        out[k] = Scheme(1, 1, job.max_tokens[k], cost, job.shape.num_layers, name=f"{k}({job.max_tokens[k]})")
    return out


# Each policy's joint step on the two-rank proxy: ``one(groups, samples, bucketing, dispatcher, tasks)``
# plans one phase of it.
REAL_STEPS: Registry = Registry("policy", "system.real.interleave")


@REAL_STEPS.register("lobra")
def _lobra_step(one, job: LobRARealJob, samples: list, schemes: dict, fits: dict) -> None:
    refused = [k for k in KINDS if "c" not in fits[k]]
    dispatcher = "length" if refused and job.dispatch == "balanced" else job.dispatch
    one([ReplicaGroup(schemes["R_L"], 1), ReplicaGroup(schemes["R_S"], 1)], samples, "dynamic", dispatcher,
        job.task_names)


@REAL_STEPS.register("task_fused")
def _task_fused_step(one, job: LobRARealJob, samples: list, schemes: dict, fits: dict) -> None:
    one([ReplicaGroup(schemes["R_L"], 2)], samples, "fixed", "even", job.task_names)


@REAL_STEPS.register("task_sequential")
def _task_sequential_step(one, job: LobRARealJob, samples: list, schemes: dict, fits: dict) -> None:
    for t in job.tasks:
        kind = "R_S" if t.lengths.max_len <= job.max_tokens["R_S"] else "R_L"
        one([ReplicaGroup(schemes[kind], 2)], [s for s in samples if s.task == t.name], "fixed", "even", [t.name])


def phases_of(job: LobRARealJob, policy: str, samples: list, schemes: dict, fits: dict) -> tuple[list, dict]:
    """Rank 0's plan of one joint step: ``[(tasks, kinds per rank, micro-batches per rank)]`` and
    facts (planner seconds, padding, dispatch status)."""
    t0 = time.perf_counter()
    names = job.task_names
    phases, real, padded, status, cuts = [], 0, 0, [], []
    predicted = [0.0, 0.0]  # per rank: the fitted cost of its micro-batches, summed over phases

    def one(groups, mine, bucketing, dispatcher, tasks):
        nonlocal real, padded
        solver = dict(time_limit_s=job.ilp_time_limit_s, mip_gap=job.ilp_gap) if dispatcher == "balanced" else {}
        sp = plan_bucketed(groups, mine, bucketing, dispatcher, num_buckets=job.num_buckets, fixed=job.fixed_buckets,
                           cuts=job.bucket_cuts, exec_mode=job.exec_mode, task_order=names, **solver)
        per_rank, kinds = [], []
        for j, g in enumerate(groups):
            for r in sp.replicas[j]:
                per_rank.append([(s, list(mb)) for s, mb in r])
                kinds.append(g.scheme.name.split("(")[0])
                predicted[len(per_rank) - 1] += replica_time(g.scheme, [(len(mb), s) for s, mb in r])
        real += sp.real_tokens
        padded += sp.padded_tokens
        status.append(sp.dispatch.status)
        cuts.append(sp.info.get("bucket_cuts", []))
        phases.append((tasks, kinds, per_rank))

    REAL_STEPS.get(policy)(one, job, samples, schemes, fits)
    info = {"planner_s": time.perf_counter() - t0, "real_tokens": real, "padded_tokens": padded, "status": status,
            "predicted_s": predicted, "bucket_cuts": cuts}
    return phases, info


def reference_grads(ref: MultiTaskLoRA, state: dict, samples: list, tasks: list) -> tuple[dict, float]:
    """One process, every sequence its own micro-batch (padded to its own length)."""
    with torch.no_grad():
        for t in tasks:
            for p, v in zip(ref.adapter_params[t], state[t]):
                p.copy_(v)
    ref.zero_grad()
    G = task_token_counts(samples)
    loss = 0.0
    for s in samples:
        loss += sum(ref.micro_batch([s], s.length, G, mode="fused").values())
    return {t: g.clone() for t, g in ref.adapter_grads().items() if t in tasks}, loss


def _rank_main(ctx, job: LobRARealJob) -> dict:
    set_torch_threads(job.threads)
    rank = ctx.rank
    # on the rank's device (cuda:<local rank> under NCCL); on the CPU the build is the seeded CPU one
    where = {"device": ctx.device if ctx.device.type != "cpu" else None, "dtype": torch_dtype(job.dtype)}
    models = {p: MultiTaskLoRA(job.shape, job.task_names, rank=job.rank, alpha=job.alpha, seed=job.seed, lr=job.lr,
                               init_b_zero=job.init_b_zero, data_seed=job.seed, **where) for p in job.policies}
    base0 = next(iter(models.values())).base_state()
    my_kind = KINDS[rank]
    timings = profile(next(iter(models.values())), job, my_kind)
    gathered: list = [None, None]
    dist.all_gather_object(gathered, timings)
    fits = {k: fit_kind(gathered[i], k) for i, k in enumerate(KINDS)}
    schemes = schemes_of(job, fits)
    ref = None
    if rank == 0 and job.check_steps > 0:
        ref = MultiTaskLoRA(job.shape, job.task_names, rank=job.rank, alpha=job.alpha, seed=job.seed, lr=job.lr,
                            init_b_zero=job.init_b_zero, data_seed=job.seed, **where)
    streams = TaskStreams(job.tasks, job.seed)
    logs: dict[str, list] = {p: [] for p in job.policies}
    checks: list[dict] = []
    for r in range(job.rounds):
        samples = streams.step()
        k = r % len(job.policies)
        for pol in job.policies[k:] + job.policies[:k]:
            model = models[pol]
            box = [phases_of(job, pol, samples, schemes, fits) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            phases, info = box[0]
            sync = r < job.check_steps  # every rank: the extra barrier after rank 0's reference
            check = sync and rank == 0
            rows = []
            for tasks, kinds, per_rank in phases:
                mine = per_rank[rank]
                everything = [x for mb in per_rank for _, xs in mb for x in xs]
                G = task_token_counts(everything)
                before = {t: [p.detach().clone() for p in model.adapter_params[t]] for t in tasks} if check else None
                model.set_checkpoint(kinds[rank] == "R_L")
                model.zero_grad()
                loss, mbt = 0.0, []
                dist.barrier()
                a = time.perf_counter()
                for s, xs in mine:
                    m0 = time.perf_counter()
                    loss += sum(model.micro_batch(xs, s, G, mode=job.exec_mode).values())
                    mbt.append((len(xs), s, time.perf_counter() - m0, kinds[rank]))
                compute = time.perf_counter() - a
                model.all_reduce_grads(tasks=tasks)
                got = {t: g.clone() for t, g in model.adapter_grads().items() if t in tasks} if check else None
                model.step()
                _sync(ctx.device)  # the step's end on the clock: Adam's kernels done
                dist.barrier()
                rows.append({"step_s": time.perf_counter() - a, "compute_s": compute, "loss_part": loss,
                             "micro_batches": mbt, "kind": kinds[rank]})
                if check:
                    want, ref_loss = reference_grads(ref, before, everything, tasks)
                    err = max(_rel(got[t], want[t]) for t in tasks)
                    checks.append({"round": r, "policy": pol, "tasks": list(tasks), "grad_rel_err": err,
                                   "ref_loss": ref_loss})
            logs[pol].append({"round": r, "phases": rows, "plan": info if rank == 0 else None})
            if sync:  # the reference ran on rank 0 only: line the ranks up again
                dist.barrier()
    base_ok = all(all(torch.equal(m.base_state()[n], v) for n, v in base0.items()) for m in models.values())
    return {"logs": logs, "checks": checks, "fits": fits, "profile": gathered, "base_bit_identical": base_ok,
            "device": str(ctx.device), "backend": ctx.backend,
            "peak_memory_bytes": peak_memory_bytes(ctx.device)}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max())
    return float((got - want).abs().max()) / (scale if scale > 0 else 1.0)


# ---- caller side ------------------------------------------------------------------------------
def make_job(system, wl, seed: int, dtype: str = "fp32") -> LobRARealJob:
    c, rk = system.cfg, system.cfg.real
    return LobRARealJob(wl.model, tuple(wl.tasks), seed, tuple(policies(system)), max_tokens_of(system, wl), c.num_buckets,
                   tuple(c.fixed_buckets), c.bucket_cuts, c.dispatch, c.exec_mode, c.ilp_time_limit_s, c.ilp_gap,
                   tuple(rk.profile_mbs), tuple(rk.profile_lengths), rk.profile_reps,
                   wl.warmup_steps + wl.steps, rk.check_steps, rk.init_b_zero, wl.lora_rank, wl.lora_alpha, wl.lr,
                   wl.torch_threads, dtype)


def run_job(job: LobRARealJob, timeout_s: float) -> list:
    # backend None: the job's execution decision (nccl when both ranks get a GPU, else gloo)
    return launch(_rank_main, 2, (job,), label="lobra real", backend=None, timeout_s=timeout_s).results


def summarise(results: list, job: LobRARealJob, warmup: int, main: str, rtol: float) -> RunResult:
    on_gpu = results[0].get("device", "cpu").startswith("cuda")
    where = ("" if on_gpu else f"GPUs: 2 CPU processes over {results[0].get('backend', 'gloo')}, {job.dtype}, "
             f"{job.threads} thread(s) each; ")
    res = RunResult(metrics={}, emulated=[f"{where}TP differences proxied by activation checkpointing + max_tokens"])
    m = res.metrics
    if on_gpu:  # torch.cuda.max_memory_allocated per rank over the whole run
        m["peak_memory_bytes"] = Metric.scalar(float(max(r["peak_memory_bytes"] for r in results)), "bytes", "lower")
    per: dict[str, list] = {}
    for pol in job.policies:
        steps = []
        for i in range(job.rounds):
            r0, r1 = results[0]["logs"][pol][i], results[1]["logs"][pol][i]
            step = sum(max(a["step_s"], b["step_s"]) for a, b in zip(r0["phases"], r1["phases"]))
            plan = r0["plan"]
            steps.append({"round": i, "step_s": step, "cpu_s": 2.0 * step, "planner_s": plan["planner_s"],
                          "pad_ratio": (plan["padded_tokens"] - plan["real_tokens"]) / plan["padded_tokens"],
                          "status": plan["status"],
                          "compute_s": [[p["compute_s"] for p in r["phases"]] for r in (r0, r1)],
                          # planned (the fits) vs measured per rank, and each rank's idle share
                          "predicted_s": plan["predicted_s"],
                          "idle_frac": [1.0 - sum(p["compute_s"] for p in r["phases"]) / step for r in (r0, r1)],
                          "loss": sum(p["loss_part"] for r in (r0, r1) for p in r["phases"])})
        per[pol] = [s for s in steps if s["round"] >= warmup]
        timed = per[pol]
        m[f"cpu_seconds__{pol}"] = Metric.scalar(sum(s["cpu_s"] for s in timed), "CPU-s", "lower")
        m[f"step_time_s__{pol}"] = Metric.from_samples([s["step_s"] for s in timed], "s", "lower")
        m[f"padding_ratio__{pol}"] = Metric.from_samples([s["pad_ratio"] for s in timed], "ratio", "lower")
        m[f"planner_time_s__{pol}"] = Metric.from_samples([s["planner_s"] for s in timed], "s", "lower")
        # The less busy rank's idle share of the step: the imbalance a dispatcher leaves.
        m[f"idle_frac__{pol}"] = Metric.from_samples([max(s["idle_frac"]) for s in timed], "fraction", "lower")
    cpu = {p: m[f"cpu_seconds__{p}"].value for p in job.policies}
    m["cpu_seconds"] = m[f"cpu_seconds__{main}"]
    # The harness's cross-system metric: here CPU processes stand in for GPUs (see emulated).
    m["gpu_seconds"] = Metric.scalar(cpu[main], "GPU-s" if on_gpu else "CPU-s", "lower")
    m["step_time_s"] = m[f"step_time_s__{main}"]
    m["padding_ratio"] = m[f"padding_ratio__{main}"]
    m["planner_time_s"] = m[f"planner_time_s__{main}"]
    m["planner_frac"] = Metric.scalar(statistics.median(s["planner_s"] / s["step_s"] for s in per[main]), "fraction",
                                      "lower")
    for pol in job.policies:
        if pol != main:
            m[f"reduction_vs_{pol}"] = Metric.scalar(1.0 - cpu[main] / cpu[pol], "fraction", "higher")
    checks = results[0]["checks"]
    if checks:
        ge = max(c["grad_rel_err"] for c in checks)
        m["grad_max_rel_err"] = Metric.scalar(ge, "fraction", "lower")
        if not ge <= rtol:
            res.mark_invalid(f"adapter gradients differ from the single-process step: max rel err {ge:.2e} > {rtol}")
    frozen = all(r["base_bit_identical"] for r in results)
    m["base_bit_identical"] = Metric.scalar(float(frozen), "bool", "higher")
    if not frozen:
        res.mark_invalid("base weights changed during training (must stay bit-identical)")
    fits = results[0]["fits"]
    for k, f in fits.items():
        if "r2" in f:
            m[f"cost_fit_r2__{k}"] = Metric.scalar(f["r2"], "R2", "higher")
    # How well the fit predicts the timed run's micro-batches (median measured / predicted).
    schemes = schemes_of(job, fits)
    ratio = {}
    for k in KINDS:
        if "c" not in fits[k]:
            continue
        rs = [t / schemes[k].t(n, s) for r in results for pol in job.policies for row in r["logs"][pol]
              if row["round"] >= warmup for ph in row["phases"] for n, s, t, kk in ph["micro_batches"] if kk == k]
        if rs:
            ratio[k] = statistics.median(rs)
    res.info = {"policies": list(job.policies), "main": main,
                "cpu_seconds": cpu, "median_step_s": {p: statistics.median(s["step_s"] for s in per[p]) for p in per},
                "cost_fit": fits, "fit_measured_over_predicted": ratio, "checks": checks,
                "steps": per, "dispatch_status": sorted({x for p in per.values() for s in p for x in s["status"]})}
    if len(per[main]) < 3:
        res.mark_invalid(f"only {len(per[main])} timed steps (need >= 3)")
    return res


def run_real(system, job: JobContext) -> RunResult:
    wl = job.workload
    rj = make_job(system, wl, job.seed, job.execution.dtype_name(wl.dtype))
    results = run_job(rj, system.cfg.real.timeout_s)
    main = system.cfg.policy if system.cfg.policy in rj.policies else rj.policies[0]
    res = summarise(results, rj, wl.warmup_steps, main, system.cfg.real.grad_rtol)
    res.info["max_tokens"] = {**rj.max_tokens, "memory": memory_rule_info(system, wl)}
    return res
