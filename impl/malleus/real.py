"""Malleus and baselines in real mode (real scenarios A-C, impl/malleus/README.md): DP x PP ranks over gloo.

Rank 0's :class:`MalleusController` turns the ranks' compute times into straggling rates
(:class:`~impl.malleus.straggler.StragglerMonitor`), checks the re-plan trigger every
``check_every`` iterations and runs the policy's planner in a background thread while
training continues on the old plan; the new plan is applied (migrated) at the first
iteration boundary after the planner returns. With ``interleave`` the controller instead
measures rates on the uniform plan during warm-up, plans every listed policy once, and then
cycles through their plans one iteration each (migrating between them), so all policies are
measured side by side on the same shared machine.
"""
from __future__ import annotations

import concurrent.futures
import math
import statistics
from typing import Optional

import numpy as np

from impl.common.api import ConfigError, JobContext, Metric, RunResult
from impl.common.parallel.plan import Plan, format_plan, group_rates
from impl.common.runtime.hybrid import Controller, HybridRunConfig, probe_once, run_hybrid
from impl.common.workloads.pipeline import ModelShape

from .policies import POLICIES
from .straggler import StragglerMonitor, probe_baseline


def _bubble_cost(plan: Plan, x, alpha) -> float:
    """Fill-bubble-inclusive Z: what re-scoring uses when there is no hardware cost model."""
    y = group_rates(plan, x, alpha)
    return max((p.micro_batches + p.num_stages - 1) * max(y[g] * n for g, n in zip(p.groups, p.layers))
               for p in plan.pipelines)


class MalleusController(Controller):
    def __init__(self, system, pcfg, warmup: int, total: int) -> None:
        self.system, self.pcfg = system, pcfg
        c = system.cfg
        self.policy, self.interleave = c.policy, list(c.interleave)
        self.warmup, self.total = warmup, total
        self.mon = StragglerMonitor(pcfg.num_gpus, c.window, c.check_every, c.replan_delta, c.healthy_below)
        self.snapshot = [1.0] * pcfg.num_gpus
        self.cache: dict = {}
        self.plans: dict = {}
        self.future = None
        self.pool = None
        self.events: list[dict] = []
        self.submitted_at: Optional[int] = None
        self.probe_base: Optional[float] = None

    def _observe(self, report: dict) -> None:
        for g, (l, m, size) in report["layout"].items():
            k = int(round(math.log2(self.pcfg.tp / size)))
            self.mon.observe_active(g, report["compute_s"][g], l, m, self.pcfg.alpha[k])
        for g in report["suspended"]:
            if self.probe_base is None:
                self.probe_base = probe_baseline([probe_once(1.0, 64) for _ in range(5)])
            self.mon.observe_suspended(g, report["probe_s"][g], self.probe_base)
        if self.mon.t_ref_s is None and self.mon.ready():
            self.mon.calibrate()

    def _plan_for(self, policy: str, x, current: Plan) -> Plan:
        alpha = self.pcfg.alpha
        plan, _ = self.system.policy_plan(policy, self.pcfg, x, current,
                                          cost_fn=lambda p: _bubble_cost(p, x, alpha), cm=None)
        return plan

    def decide(self, it: int, current: Plan, report: Optional[dict]) -> Optional[Plan]:
        if report is not None:
            self._observe(report)
        if self.interleave:
            if it < self.warmup:
                return None
            if not self.plans:
                x = self.mon.rates(self.snapshot) if self.mon.t_ref_s else list(self.snapshot)
                self.snapshot = x
                for pol in self.interleave:
                    self.plans[pol] = self._plan_for(pol, x, current).with_label(pol)
                self.events.append({"iteration": it, "rates": [round(v, 3) for v in x],
                                    "plans": {k: format_plan(v) for k, v in self.plans.items()}})
            return self.plans[self.interleave[(it - self.warmup) % len(self.interleave)]]
        if not POLICIES.get(self.policy).react:
            return None
        # a finished background plan applies at this boundary
        if self.future is not None and self.future.done():
            new, x = self.future.result()
            self.future = None
            self.snapshot = x
            self.mon.reset()
            self.events.append({"iteration": it, "submitted": self.submitted_at, "rates": [round(v, 3) for v in x],
                                "plan": format_plan(new)})
            return new
        if (self.future is None and self.mon.t_ref_s is not None and it % self.system.cfg.check_every == 0
                and self.mon.ready()):
            x = self.mon.rates(self.snapshot)
            if self.mon.replan_due(x, self.snapshot, current.suspended):
                key = self.mon.cache_key(x, current.suspended)
                self.submitted_at = it
                if self.pool is None:
                    self.pool = concurrent.futures.ThreadPoolExecutor(1)
                if key in self.cache:
                    fut = concurrent.futures.Future()
                    fut.set_result((self.cache[key], x))
                    self.future = fut
                else:
                    def work(x=list(x), cur=current, key=key):
                        p = self._plan_for(self.policy, x, cur)
                        self.cache[key] = p
                        return p, x
                    self.future = self.pool.submit(work)
        return None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def summary(self) -> dict:
        return {"events": self.events}


def tiny_shape(model) -> ModelShape:
    if getattr(model, "ffn_hidden", 0):
        raise ConfigError("workload.model.ffn_hidden: real mode runs the tiny GPT (ffn_hidden must be 0)")
    return ModelShape(name=model.name, num_layers=model.num_layers, hidden=model.hidden, heads=model.heads,
                      ffn_mult=model.ffn_mult, ffn_hidden=0, vocab=model.vocab, seq_len=model.seq_len)


def check_real(system, wl) -> None:
    """Real-mode limits, checked at preflight (:meth:`HybridTraining.check`)."""
    if wl.tp != 1:
        raise ConfigError(f"workload.tp: real mode runs DP x PP only (tp=1 on CPU), got tp={wl.tp}")
    if system.policy.by_restart and not system.cfg.interleave:
        raise ConfigError(f"system.policy: {system.cfg.policy} runs in sim mode only (a real restart is not emulated)")
    tiny_shape(wl.model)


def run_real(system, job: JobContext) -> RunResult:
    wl, cfg = job.workload, system.cfg
    shape = tiny_shape(wl.model)
    alpha = system.alpha("real", wl, job.hardware)
    pcfg = system.planner_config(wl, job.hardware, alpha)
    total = wl.warmup_iterations + wl.iterations
    controller = MalleusController(system, pcfg, wl.warmup_iterations, total)
    rcfg = HybridRunConfig(shape, wl.num_gpus, wl.micro_batch_size, wl.num_microbatches, total, job.seed,
                           pcfg.uniform().to_dict(), job.fault, wl.layer_fwd_pad_s, wl.layer_bwd_pad_s, wl.optimizer,
                           wl.lr, cfg.bucket_mb * 2 ** 20, wl.torch_threads, True, False, cfg.timeout_s)
    out = run_hybrid(rcfg, controller)
    times = out["iteration_times_s"]
    result = RunResult(metrics={}, emulated=["GPU compute: sleep-padded per layer and micro-batch (impl/malleus/README.md, real scenarios)"])
    meas = list(range(wl.warmup_iterations, total))
    metrics = {"iteration_time_s": Metric.from_samples([times[i] for i in meas], "s", "lower")}
    if cfg.interleave:
        per = {pol: [times[i] for i in meas if (i - wl.warmup_iterations) % len(cfg.interleave) == k]
               for k, pol in enumerate(cfg.interleave)}
        for pol, ts in per.items():
            metrics[f"iteration_time_s__{pol}"] = Metric.from_samples(ts, "s", "lower")
        main = cfg.policy if cfg.policy in per else cfg.interleave[-1]
        metrics["iteration_time_s"] = metrics[f"iteration_time_s__{main}"]
        for pol in per:
            if pol != main:
                metrics[f"speedup_vs_{pol}"] = Metric.scalar(statistics.median(per[pol]) / statistics.median(per[main]),
                                                             "x", "higher")
    events = out.get("controller", {}).get("events", [])
    change = _first_change(job.fault, total)
    if not cfg.interleave and change is not None:
        replans_after = [e for e in events if e["iteration"] >= change]
        if replans_after:
            det = replans_after[0]["submitted"] - change if replans_after[0]["submitted"] is not None else None
            metrics["detection_iterations"] = Metric.scalar(det if det is not None else float("nan"), "iterations", "lower")
            before = [times[i] for i in range(change) if any(e["iteration"] <= i for e in events)]
            level = statistics.median(before[-4:]) if before else statistics.median(times[:change])
            rec = next((i for i in range(change, total) if times[i] <= 1.15 * level), None)
            metrics["recovery_iterations"] = Metric.scalar(rec - change if rec is not None else float("nan"),
                                                           "iterations", "lower")
            metrics["static_level_s"] = Metric.scalar(level, "s", "lower")
    metrics["replans"] = Metric.scalar(len(out["migrations"]), "count", "lower")
    metrics["migration_s"] = Metric.scalar(sum(m["seconds"] for m in out["migrations"]), "s", "lower")
    metrics["migration_checks"] = Metric.scalar(out["migration_checks"], "units", "higher")
    result.metrics = metrics
    # consumed-sample counter continuity
    flat = [r for it in out["consumed"] for r in it]
    if any(b[0] != a[1] for a, b in zip(flat, flat[1:])) or (flat and flat[0][0] != 0):
        result.mark_invalid("consumed-sample ranges are not continuous")
    if cfg.check_losses:
        from impl.common.models.tiny_gpt import reference_train

        ref = reference_train(shape, wl.micro_batch_size, wl.num_microbatches, total, job.seed, wl.optimizer, wl.lr)
        got, exp = np.array(out["losses"]), np.array(ref.losses)
        err = float(np.max(np.abs(got - exp) / np.abs(exp)))
        metrics["loss_max_rel_err"] = Metric.scalar(err, "fraction", "lower")
        if not err <= cfg.loss_rtol:
            result.mark_invalid(f"losses differ from the single-process reference: max rel err {err:.2e} > {cfg.loss_rtol}")
    if len(meas) < 3:
        result.mark_invalid(f"only {len(meas)} measured iterations (need >= 3)")
    final = Plan.from_dict(out["plans"][-1])
    result.info = {"iteration_times_s": times, "events": events[:20], "final_plan": format_plan(final),
                   "plans_per_iteration": [format_plan(Plan.from_dict(p)).splitlines()[1:] for p in out["plans"]][:40],
                   "migrations": out["migrations"][:20], "final_plan_dict": final.to_dict()}
    return result


def _first_change(fault, total: int) -> Optional[int]:
    from impl.common.fault_model.compute_slowdown import change_iterations

    ch = change_iterations(fault, total)
    return ch[0] if ch else None
