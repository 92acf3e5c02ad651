"""ADAPTRA and its baselines as harness systems (one class, variants chosen by knobs).

| system      | schedule                         | P2P path                              |
|-------------|----------------------------------|---------------------------------------|
| adaptra     | Alg. 2 + Alg. 3/4, delay-aware   | host delegates once a delay is seen   |
| adaptra_cpu | ZB, delay-blind                  | host delegates once a delay is seen   |
| zb          | ZB, delay-blind                  | in-stream FIFO, depth 1 (HOL)         |
| 1f1b        | Megatron 1F1B                    | in-stream FIFO, depth 1 (HOL)         |

Sim mode replays each iteration's schedule in the discrete-event simulator; real mode runs it
on S local processes (impl.common.runtime). Both read the same fault spec.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

from faults.link_delay import link_delays_at, validate_link_delay
from impl.common.api import ConfigError, JobContext, Metric, RunResult, System
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.generators import generate
from impl.common.schedule.ir import Schedule

SCHEDULES = ("adaptra", "zb", "1f1b", "gpipe")
# latency: no queueing at all (the spec's "simulator reference", sim only).
COMMS = ("inline", "in_stream", "delegated", "latency")
DELEGATE_WHEN = ("always", "on_delay")
DETECTIONS = ("oracle", "measured")


SUPPORTED_FAULTS = ("none", "link_delay")


class PipelineTraining(System):
    @dataclass
    class Config:
        schedule: str = "adaptra"
        comm: str = "delegated"
        # When the delegated path is on: from the first iteration, or only once a delay is seen
        # (spec 2.5: before detection, traffic uses GPU-direct RDMA).
        delegate_when: str = "on_delay"
        # 'paper' or 'artifact' form of Alg. 2 (spec 2.3); recorded in info.
        adapt_formula: str = "paper"
        # Delegates per direction; 0 = the artifact's rule (3, or 6 above 30 ms).
        num_delegates: int = 0
        queue_depth: int = 1
        cpu_penalty: float = 1.15
        steps_per_op: int = 30
        # Write a Chrome trace and a timeline PNG of the slowest simulated iteration.
        timeline: bool = True

    def __init__(self, cfg, name):
        super().__init__(cfg, name)
        for field, allowed in (("schedule", SCHEDULES), ("comm", COMMS), ("delegate_when", DELEGATE_WHEN),
                               ("adapt_formula", ("paper", "artifact"))):
            value = getattr(cfg, field)
            if value not in allowed:
                raise ConfigError(f"system.{field}: unknown value {value!r} (one of: {', '.join(allowed)})")
        if cfg.queue_depth < 1:
            raise ConfigError(f"system.queue_depth must be >= 1, got {cfg.queue_depth}")
        if cfg.num_delegates < 0:
            raise ConfigError(f"system.num_delegates must be >= 0 (0 = automatic), got {cfg.num_delegates}")

    # ---- shared by both modes -------------------------------------------------------------
    def _delays(self, job: JobContext, iteration: int) -> dict:
        return link_delays_at(job.fault, iteration, job.workload.stages)

    def _detected(self, job: JobContext, iteration: int) -> dict:
        """Delays the scheduler acts on at ``iteration``.

        oracle: the injected table itself (the artifact reads it from Redis each iteration).
        measured (sim): what per-link timers saw during the previous iteration, i.e. one
        iteration of lag; the real runtime measures transit times instead.
        """
        detection = getattr(job.fault, "detection", "oracle")
        if detection == "oracle":
            return self._delays(job, iteration)
        return self._delays(job, iteration - 1) if iteration > 0 else {}

    def _delegates(self, job: JobContext, max_delay_s: float) -> int:
        n = job.workload.num_microbatches
        from impl.common.runtime.executor import default_num_delegates

        k = self.cfg.num_delegates or default_num_delegates(max_delay_s)
        if n % k:
            raise ConfigError(f"workload.num_microbatches {n} is not divisible by delegate count {k} "
                              f"(system.num_delegates)")
        return k

    def _uses_delegates(self, detected: dict) -> bool:
        if self.cfg.comm != "delegated":
            return False
        return self.cfg.delegate_when == "always" or any(v > 0 for v in detected.values())

    def _compute_schedule(self, tF, tB, tW, detected: dict, S: int, N: int) -> tuple[Schedule, Optional[list]]:
        if self.cfg.schedule == "adaptra":
            from impl.adaptra.builder import adaptra_schedule

            c = [detected.get((i, i + 1), 0.0) for i in range(S - 1)]
            sched, warmup = adaptra_schedule(tF, tB, tW, c, N, formula=self.cfg.adapt_formula,
                                             steps_per_op=self.cfg.steps_per_op)
            return sched, warmup
        return generate(self.cfg.schedule, S, N), None

    def run(self, job: JobContext) -> RunResult:
        wl = job.workload
        if wl.stages < 1 or wl.num_microbatches < 1:
            raise ConfigError(f"workload.stages ({wl.stages}) and workload.num_microbatches "
                              f"({wl.num_microbatches}) must be >= 1")
        if job.fault.kind not in SUPPORTED_FAULTS:
            raise ConfigError(f"fault.kind: system {self.name!r} does not support fault {job.fault.kind!r} "
                              f"(supports: {', '.join(SUPPORTED_FAULTS)})")
        validate_link_delay(job.fault, wl.stages)
        if job.mode == "sim":
            return self._run_sim(job)
        return self._run_real(job)

    # ---- sim -------------------------------------------------------------------------------
    def _costs(self, job: JobContext):
        from impl.common.cost.comm import LinkCosts
        from impl.common.cost.transformer import StageCosts, activation_msg_bytes, stage_costs

        wl = job.workload
        msg = activation_msg_bytes(wl.micro_batch_size, wl.model.seq_len, wl.model.hidden, wl.dtype)
        if wl.sim_op_time_s:
            # Hand-set op times (spec 5's "t = 10 ms" reference): comm is free except delays.
            return StageCosts.uniform(wl.stages, wl.sim_op_time_s), LinkCosts.uniform(wl.stages, 0.0, msg)
        costs = stage_costs(wl.model, wl.stages, wl.micro_batch_size, wl.dtype, wl.tp, job.hardware)
        return costs, LinkCosts.from_hardware(wl.stages, msg, job.hardware, tp=wl.tp, dp=wl.dp)

    def _stream_comm(self):
        from impl.common.sim.pipeline import CommModel

        if self.cfg.comm == "latency":
            return CommModel(kind="latency")
        # inline sends block until delivered; in the simulator that is a depth-1 FIFO too.
        return CommModel(kind="in_stream", queue_depth=self.cfg.queue_depth)

    def _run_sim(self, job: JobContext) -> RunResult:
        from impl.common.sim.pipeline import CommModel, simulate_iteration

        wl = job.workload
        S, N = wl.stages, wl.num_microbatches
        costs, link = self._costs(job)
        tF, tB, tW = list(costs.tf_s), list(costs.tb_s), list(costs.tw_s)
        iters = wl.warmup_iterations + wl.iterations
        cache: dict = {}
        times, bubbles, hol, dep, plans = [], [], [], [], []
        worst = None
        for it in range(iters):
            injected = self._delays(job, it)
            detected = self._detected(job, it)
            delegated = self._uses_delegates(detected)
            max_delay = max(list(detected.values()) + [0.0])
            if delegated:
                comm = CommModel(kind="delegated", delegates=self._delegates(job, max_delay),
                                 cpu_penalty=self.cfg.cpu_penalty)
            else:
                comm = self._stream_comm()
            plan_key = tuple(sorted(detected.items())) if self.cfg.schedule == "adaptra" else ()
            key = (plan_key, tuple(sorted(injected.items())), comm)
            if key not in cache:
                sched, warmup = self._compute_schedule(tF, tB, tW, dict(plan_key), S, N)
                cache[key] = (simulate_iteration(insert_comm(sched), costs, link, comm, delays=injected), warmup, comm)
            res, warmup, comm = cache[key]
            if it < wl.warmup_iterations:
                continue
            times.append(res.iteration_time_s)
            T = res.iteration_time_s
            bubbles.append(res.bubble_fraction())
            hol.append(sum(b.hol_s for b in res.breakdown) / (S * T))
            dep.append(sum(b.dependency_s for b in res.breakdown) / (S * T))
            plans.append({"iteration": it, "delays_s": {f"{a}-{b}": v for (a, b), v in injected.items()},
                          "warmup": warmup, "comm": comm.kind, "delegates": comm.delegates if comm.kind == "delegated" else 0})
            if worst is None or T > worst.iteration_time_s:
                worst = res
        # The same policy with no delay at all: the denominator of the paper's "slowdown".
        sched0, _ = self._compute_schedule(tF, tB, tW, {}, S, N)
        comm0 = (CommModel(kind="delegated", delegates=self._delegates(job, 0.0), cpu_penalty=self.cfg.cpu_penalty)
                 if self.cfg.comm == "delegated" and self.cfg.delegate_when == "always"
                 else self._stream_comm())
        t0 = simulate_iteration(insert_comm(sched0), costs, link, comm0).iteration_time_s
        samples_per_iter = wl.micro_batch_size * N * max(wl.dp, 1)
        metrics = {
            "iteration_time_s": Metric.from_samples(times, "s", "lower"),
            "total_time_s": Metric.scalar(math.fsum(times), "s", "lower"),
            "throughput_samples_per_s": Metric.scalar(samples_per_iter * len(times) / math.fsum(times), "samples/s", "higher"),
            "slowdown_vs_no_delay": Metric.from_samples([t / t0 for t in times], "x", "lower"),
            "bubble_fraction": Metric.from_samples(bubbles, "fraction", "lower"),
            "hol_share": Metric.from_samples(hol, "fraction", "lower"),
            "dependency_bubble_share": Metric.from_samples(dep, "fraction", "lower"),
        }
        result = RunResult(metrics=metrics, info={
            "schedule": self.cfg.schedule, "comm": self.cfg.comm, "adapt_formula": self.cfg.adapt_formula,
            "detection": getattr(job.fault, "detection", "oracle"), "no_delay_iteration_time_s": t0,
            "op_times_s": {"tF": tF[0], "tB": tB[0], "tW": tW[0]} if len(set(tF)) == 1 else {"tF": tF, "tB": tB, "tW": tW},
            "plans": plans[:20], "distinct_plans": len(cache)})
        if self.cfg.timeline and worst is not None:
            trace = job.out_dir / "timeline.trace.json"
            trace.write_text(json.dumps(worst.to_chrome_trace()))
            from impl.common.plots.timeline import plot_sim_timeline

            png = plot_sim_timeline(worst, job.out_dir / "timeline.png",
                                    f"{self.name} (sim) S={S} N={N}: slowest iteration {worst.iteration_time_s * 1e3:.0f} ms")
            result.artifacts += [trace.name, png.name]
        return result

    # ---- real ------------------------------------------------------------------------------
    def _run_real(self, job: JobContext) -> RunResult:
        from impl.adaptra.real import run_real

        return run_real(self, job)


class SchedulerGap(System):
    """S8: ADAPTRA's list scheduler against the MILP optimum on the workload's (S, N).

    Uniform op time ``workload.sim_op_time_s`` and the fault's link delays (first iteration).
    """

    modes = ("sim",)

    @dataclass
    class Config:
        adapt_formula: str = "paper"
        # 'quota': the MILP is held to the same activation quotas the builder runs under.
        memory: str = "quota"
        time_limit_s: float = 60.0

    def run(self, job: JobContext) -> RunResult:
        from impl.adaptra.milp import scheduler_gap

        wl = job.workload
        if not wl.sim_op_time_s:
            raise ConfigError("workload.sim_op_time_s: the scheduler-gap experiment needs a uniform op time")
        validate_link_delay(job.fault, wl.stages)
        delays = link_delays_at(job.fault, 0, wl.stages)
        c = [delays.get((i, i + 1), 0.0) for i in range(wl.stages - 1)]
        out = scheduler_gap(wl.stages, wl.num_microbatches, wl.sim_op_time_s, c, self.cfg.adapt_formula,
                            memory=self.cfg.memory, time_limit_s=self.cfg.time_limit_s)
        result = RunResult(metrics={
            "builder_makespan_s": Metric.scalar(out["builder_s"], "s", "lower"),
            "milp_makespan_s": Metric.scalar(out["milp_s"], "s", "lower"),
            "milp_bound_s": Metric.scalar(out["milp_bound_s"], "s", "higher"),
            "scheduler_gap": Metric.scalar(out["gap"], "fraction", "lower"),
        }, info={"milp_status": out["milp_status"], "warmup": out["warmup"], "c_s": list(c),
                 "milp_solver_gap": out["milp_solver_gap"]})
        if out["milp_status"] != "optimal":
            result.mark_invalid(f"MILP not proved optimal ({out['milp_status']}); gap is against the incumbent")
        return result
