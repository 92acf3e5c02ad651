"""Malleus (Li et al., arXiv 2410.13333, SIGMOD 2025) and its baselines as harness systems (one
class, the policy chosen by a knob).

| system          | plan                                                           | on a change          |
|-----------------|----------------------------------------------------------------|----------------------|
| malleus         | six-step planner (regroup TP, stages, layers, micro-batches)   | async plan + live migration |
| uniform         | Megatron 3D layout                                             | nothing              |
| data_only       | uniform layout, micro-batches by ILP-B                         | live (free) switch   |
| layers_only     | uniform layout, layers by ILP-A per pipeline                   | live migration       |
| restart_replan  | drop straggling nodes, best homogeneous layout (B3)            | checkpoint + restart |

Sim mode prices each iteration's plan with :func:`impl.common.parallel.cost.iteration_cost`
under the fault's per-GPU factors; detection, planner latency (modelled, overlapped with
training) and migration time (bytes / bandwidth) are part of the loop, so the same policy
code drives sim and real (:mod:`impl.malleus.real`).
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import List, Optional

from impl.common.fault_model.compute_slowdown import slowdown_at, validate_compute_slowdown
from impl.common.api import ConfigError, JobContext, Metric, RunResult, System
from impl.common.parallel.cost import HybridCostModel, iteration_cost, memory_model, state_bytes_per_layer
from impl.common.parallel.migration import migration_time_s, plan_migration
from impl.common.parallel.plan import Plan, format_plan, group_rates, plan_diff, plan_z, z_lower_bound
from impl.common.parallel.planner import PlannerConfig, check_feasible, check_uniform_fits
from impl.common.parallel.tp_groups import check_shrink_penalty, shrink_levels

from .policies import POLICIES, RESTART_PLANS, MalleusPolicy
from .straggler import StragglerMonitor

SUPPORTED_FAULTS = ("none", "compute_slowdown")


@dataclass
class _Pending:
    plan: Plan
    ready_at_s: float
    snapshot: list


class HybridTraining(System):
    @dataclass
    class Config:
        policy: str = "malleus"
        # 'measured': per-GPU compute timers + hysteresis (impl/malleus/straggler.py); 'oracle': the injected factors.
        detection: str = "measured"
        check_every: int = 3
        window: int = 2
        replan_delta: float = 0.3
        healthy_below: float = 1.2
        top_k: int = 5
        # w_k of the TP-grouping score per shrink level k = log2(tp / group size); index 0 (a
        # full group) is 1.0. Needs >= log2(tp) + 1 entries.
        shrink_penalty: List[float] = field(default_factory=lambda: [1.0, 2.0, 2.0, 2.0])
        solver_a: str = "cbc"
        solver_b: str = "highs"  # or "search" (exact combinatorial, for >= 512 GPUs)
        rescore: bool = True
        # Sim: modelled planner wall time (training continues on the old plan meanwhile).
        planner_latency_s: float = 30.0
        # restart_replan: 'exclude' (B3: drop straggling nodes) or 'malleus' (the ablation:
        # Malleus's plan, applied by checkpoint-restart instead of live migration).
        restart_plan: str = "exclude"
        restart_init_s: float = 120.0  # process launch + framework init + warm-up
        ckpt_bw_bytes_per_s: float = 2.0e9  # per GPU, save and load each
        # Sim: spread restart costs over this many iterations of a straggler episode
        # ([R]: impl/malleus/README.md, "Sim timing"); 0 = charge them at the iteration they happen.
        episode_iterations: int = 500
        # Real: bucket size of the batched migration P2P (bounds its extra peak memory).
        bucket_mb: float = 1.0
        # Real: run these policies' plans interleaved in one job (one iteration each per
        # round, migrating between them) and report each one's median: the fair comparison
        # on a shared machine. Empty = this policy only.
        interleave: List[str] = field(default_factory=list)
        # Real: also run the single-process reference on the same global batches and check
        # every iteration's losses (rtol below); a mismatch marks the run invalid.
        check_losses: bool = True
        loss_rtol: float = 1e-5
        timeout_s: float = 600.0

        def __post_init__(self):
            for fld, allowed in (("policy", POLICIES.names()), ("detection", ("measured", "oracle")),
                                 ("restart_plan", RESTART_PLANS.names()), ("solver_a", ("cbc", "highs")),
                                 ("solver_b", ("cbc", "highs", "search"))):
                if getattr(self, fld) not in allowed:
                    raise ConfigError(f"system.{fld}: unknown value {getattr(self, fld)!r} (one of: {', '.join(allowed)})")
            for k in self.interleave:
                if k not in POLICIES:
                    raise ConfigError(f"system.interleave: unknown policy {k!r} (one of: {', '.join(POLICIES.names())})")
            if self.check_every < 1 or self.window < 1:
                raise ConfigError(f"system.check_every ({self.check_every}) and system.window ({self.window}) must be >= 1")
            if self.top_k < 1:
                raise ConfigError(f"system.top_k must be >= 1, got {self.top_k}")

    @property
    def policy(self) -> MalleusPolicy:
        return POLICIES.get(self.cfg.policy)

    # ---- shared ------------------------------------------------------------------------
    def alpha(self, mode: str, wl, hardware) -> list[float]:
        """TP-shrink slowdowns: the workload's, else the cost model's (sim) or [1] (real, tp=1)."""
        if wl.alpha:
            return list(wl.alpha)
        if mode == "sim":
            return HybridCostModel.build(wl, hardware).alpha(shrink_levels(wl.tp))
        return [1.0]

    def planner_config(self, wl, hardware, alpha) -> PlannerConfig:
        if wl.global_batch_size % wl.micro_batch_size:
            raise ConfigError(f"workload.global_batch_size {wl.global_batch_size} is not a multiple of "
                              f"micro_batch_size {wl.micro_batch_size}")
        check_shrink_penalty("system.shrink_penalty", self.cfg.shrink_penalty, wl.tp)
        c = self.cfg
        return PlannerConfig(num_gpus=wl.num_gpus, gpus_per_node=wl.gpus_per_node, dp=wl.dp, tp=wl.tp, pp=wl.pp,
                             num_layers=wl.model.num_layers, num_microbatches=wl.num_microbatches, alpha=tuple(alpha),
                             memory=memory_model(wl, hardware), top_k=c.top_k,
                             shrink_penalty=tuple(c.shrink_penalty), healthy_below=c.healthy_below,
                             solver_a=c.solver_a, solver_b=c.solver_b)

    def check(self, mode, wl, hardware, fault) -> None:
        """Whole-job checks, at preflight: workload and fault kinds, the planner's inputs, the
        nominal layout's memory, and the planner's grouping at every change of the fault."""
        self.require_workload(wl, "hybrid")
        if fault.kind not in SUPPORTED_FAULTS:
            raise ConfigError(f"fault.kind: system {self.name!r} does not support fault {fault.kind!r} "
                              f"(supports: {', '.join(SUPPORTED_FAULTS)})")
        validate_compute_slowdown(fault, wl.num_gpus)
        if mode == "real":
            from .real import check_real

            check_real(self, wl)
        pcfg = self.planner_config(wl, hardware, self.alpha(mode, wl, hardware))
        check_uniform_fits(pcfg.uniform(), pcfg)
        if self.policy.runs_planner(self.cfg.restart_plan):
            from impl.common.fault_model.compute_slowdown import change_iterations

            iters = wl.warmup_iterations + wl.iterations
            for it in [0] + change_iterations(fault, iters):
                check_feasible(pcfg, slowdown_at(fault, it, wl.num_gpus))

    def policy_plan(self, policy: str, pcfg: PlannerConfig, x, old: Plan, cost_fn=None, cm=None) -> tuple[Plan, dict]:
        plan_fn = POLICIES.get(policy).plan_fn(self.cfg.restart_plan)
        return plan_fn(pcfg, x, old, cost_fn if self.cfg.rescore else None, cm)

    def run(self, job: JobContext) -> RunResult:
        if job.mode == "sim":
            return self._run_sim(job)
        from .real import run_real

        return run_real(self, job)

    # ---- sim ---------------------------------------------------------------------------
    def restart_cost_s(self, plan: Plan, cm: HybridCostModel) -> float:
        per_layer = state_bytes_per_layer(cm)
        worst = max(max(p.layers) for p in plan.pipelines) * per_layer / min(g.size for g in plan.groups)
        return self.cfg.restart_init_s + 2.0 * worst / self.cfg.ckpt_bw_bytes_per_s

    def _run_sim(self, job: JobContext) -> RunResult:
        wl, hw, cfg = job.workload, job.hardware, self.cfg
        cm = HybridCostModel.build(wl, hw)
        alpha = self.alpha("sim", wl, hw)
        pcfg = self.planner_config(wl, hw, alpha)
        N = wl.num_gpus
        current = pcfg.uniform()
        t_free = iteration_cost(current, [1.0] * N, cm).iteration_time_s
        mon = StragglerMonitor(N, cfg.window, cfg.check_every, cfg.replan_delta, cfg.healthy_below,
                               t_ref_s=cm.layer_time_s(wl.tp))
        snapshot = [1.0] * N
        cache: dict = {}
        pending: Optional[_Pending] = None
        clock = 0.0
        iters = wl.warmup_iterations + wl.iterations
        times, history, restart_total, migration_total, replans = [], [], 0.0, 0.0, 0
        extra_by_iter: dict[int, float] = {}
        per_layer_state = state_bytes_per_layer(cm)
        L = wl.model.num_layers

        def unit_bytes(u: int) -> float:
            return per_layer_state if 0 <= u < L else per_layer_state * 0.5

        policy = self.policy
        react = policy.react
        it_range = range(iters)
        if job.show_progress:
            from tqdm import tqdm

            it_range = tqdm(it_range, desc=f"{self.name} sim", leave=False)
        last_info: dict = {}
        for it in it_range:
            x_true = slowdown_at(job.fault, it, N)
            stall = 0.0
            # apply a finished plan at this iteration boundary
            if pending is not None and clock >= pending.ready_at_s:
                if pending.plan.signature() != current.signature():
                    if policy.by_restart:
                        stall = self.restart_cost_s(pending.plan, cm)
                        restart_total += stall
                    else:
                        transfers, summ = plan_migration(current, pending.plan, unit_bytes)
                        stall = migration_time_s(transfers, cm.intra_bw_bytes_per_s, cm.inter_bw_bytes_per_s,
                                                 cm.inter_lat_s)
                        migration_total += stall
                    history.append({"iteration": it, "plan": pending.plan.label, "stall_s": stall,
                                    "diff": plan_diff(current, pending.plan)[:12]})
                    current = pending.plan
                    replans += 1
                    mon.reset()
                snapshot = pending.snapshot
                pending = None
            cost = iteration_cost(current, x_true, cm)
            t = cost.iteration_time_s
            if not policy.by_restart or cfg.episode_iterations == 0:
                t += stall
            clock += t
            if it >= wl.warmup_iterations:
                times.append(t)
            if not react:
                continue
            # observe (compute-only time per GPU; probe for suspended GPUs)
            if cfg.detection == "oracle":
                x_seen, due = list(x_true), mon.cache_key(x_true, current.suspended) != mon.cache_key(snapshot, current.suspended)
            else:
                lay = current.gpu_layout()
                for g, e in lay.items():
                    k = int(round(math.log2(current.tp / e["tp_size"])))
                    m = current.pipelines[e["pipeline"]].micro_batches
                    n = e["layers"][1] - e["layers"][0]
                    mon.observe_active(g, cost.gpu_compute_s[g], n, m, cm.layer_time_s(e["tp_size"]) / cm.layer_time_s(wl.tp))
                for g in current.suspended:
                    mon.observe_suspended(g, x_true[g], 1.0)
                x_seen = mon.rates(snapshot)
                due = ((it + 1) % cfg.check_every == 0 and mon.ready()
                       and mon.replan_due(x_seen, snapshot, current.suspended))
            if due and pending is None:
                key = mon.cache_key(x_seen, current.suspended)
                if key in cache:
                    new, latency = cache[key], 0.0
                else:
                    new, last_info = self.policy_plan(cfg.policy, pcfg, x_seen, current,
                                                      cost_fn=lambda p, xs=list(x_seen): iteration_cost(p, xs, cm).iteration_time_s,
                                                      cm=cm)
                    cache[key] = new
                    latency = cfg.planner_latency_s if cfg.detection == "measured" else 0.0
                pending = _Pending(new, clock + latency, list(x_seen))
        if policy.by_restart and cfg.episode_iterations > 0 and restart_total > 0:
            share = restart_total / cfg.episode_iterations
            times = [t + share for t in times]
        x_end = slowdown_at(job.fault, iters - 1, N)
        y_end = group_rates(current, x_end, alpha)
        med = statistics.median(times)
        samples = wl.global_batch_size
        metrics = {
            "iteration_time_s": Metric.from_samples(times, "s", "lower"),
            "total_time_s": Metric.scalar(math.fsum(times), "s", "lower"),
            "throughput_samples_per_s": Metric.scalar(samples * len(times) / math.fsum(times), "samples/s", "higher"),
            "straggler_free_iteration_time_s": Metric.scalar(t_free, "s", "lower"),
            "slowdown_vs_straggler_free": Metric.scalar(med / t_free, "x", "lower"),
            "z_units": Metric.scalar(plan_z(current, y_end), "layer-microbatches", "lower"),
            "z_over_lower_bound": Metric.scalar(plan_z(current, y_end) / z_lower_bound(current, y_end), "x", "lower"),
            "replans": Metric.scalar(replans, "count", "lower"),
            "migration_s": Metric.scalar(migration_total, "s", "lower"),
            "restart_s": Metric.scalar(restart_total, "s", "lower"),
        }
        job.out_dir.mkdir(parents=True, exist_ok=True)
        (job.out_dir / "plan.json").write_text(json.dumps(current.to_dict(), indent=1))
        (job.out_dir / "plan.txt").write_text(format_plan(current, y_end) + "\n")
        return RunResult(metrics=metrics, artifacts=["plan.json", "plan.txt"], info={
            "policy": cfg.policy, "alpha": alpha, "final_plan": format_plan(current, y_end),
            "history": history[:20], "planner": last_info, "straggler_free_iteration_time_s": t_free})
