"""ADAPTRA and its baselines as harness systems (one class, variants chosen by knobs).

| system      | schedule                         | P2P path                              |
|-------------|----------------------------------|---------------------------------------|
| adaptra     | Alg. 2 + Alg. 3/4, delay-aware   | host delegates once a delay is seen   |
| adaptra_cpu | ZB, delay-blind                  | host delegates once a delay is seen   |
| zb          | ZB, delay-blind, <= 2S-1 stored  | in-stream FIFO, depth 1 (HOL)         |
| zb_uncapped | ZB, delay-blind, no act. cap     | in-stream FIFO, depth 1 (HOL)         |
| 1f1b        | Megatron 1F1B                    | in-stream FIFO, depth 1 (HOL)         |

Sim mode replays each iteration's schedule in the discrete-event simulator; real mode runs it
on S local processes (impl.common.runtime). Both read the same fault spec.

Sim mode also models (scenarios S5-S7; impl/adaptra/README.md, "Sim-mode scenario models" [R]):
- the gradient all-reduce of every stage when workload.dp > 1 (bucketed ring, exposed after the
  stage's last weight gradient), and a slow DP link on it (fault kind ``dp_link_delay``);
  ``dp_link_policy`` says what the system does about one (ignore, or remap it into a pipeline
  link once detected; Falcon's ski-rental ladder in impl.adaptra.falcon);
- delays that change inside iterations (fault kind ``varying_link_delay``); plans still change
  only at iteration boundaries, from what the system saw;
- a static slow GPU (fault kind ``compute_slowdown``, no trace): every op of a stage runs at
  its slowest GPU's factor (the stage's DP replicas wait for it at the gradient all-reduce; GPU
  g sits in stage g // (dp*tp), Megatron's layout); no schedule re-plans around it. Real mode
  (dp = tp = 1) stretches the slow rank's padded op time by its factor;
- RNIC failures (``fault.rnic_failure_iters``): delegated systems fail over for free and stay
  on the delegated path, the others pay ``restart_cost_s`` once per failure.
One-time costs (remap, restart) go to ``total_time_s``, not to iteration times.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import ClassVar, Optional

from faults.dp_link import dp_link_delays_at, validate_dp_link_delay
from impl.common.fault_model.link_delay import link_delays_at, validate_link_delay
from faults.varying_delay import DelayTimeline, validate_varying_link_delay
from impl.adaptra.mitigate import DP_LINK_POLICIES
from impl.adaptra.policies import COMMS, INLINE_MODELS, SCHEDULES
from impl.common.api import ConfigError, JobContext, Metric, RunResult, System
from impl.common.schedule.comm import insert_comm
from impl.common.schedule.ir import Schedule

DELEGATE_WHEN = ("always", "on_delay")
P2P_ORDERS = ("batch", "schedule")
DETECTIONS = ("oracle", "measured")


SIM_ONLY_FAULTS = ("dp_link_delay", "varying_link_delay")


class PipelineTraining(System):
    SUPPORTED_FAULTS = ("none", "link_delay", "dp_link_delay", "varying_link_delay", "rank_kill", "compute_slowdown")

    @dataclass
    class Config:
        schedule: str = "adaptra"
        comm: str = "delegated"
        # When the delegated path is on: from the first iteration, or only once a delay is seen
        # (the paper: before detection, traffic uses GPU-direct RDMA).
        delegate_when: str = "on_delay"
        # 'paper' or 'artifact' form of Alg. 2 (the paper vs the authors' code); recorded in info.
        adapt_formula: str = "paper"
        # Delegates per direction; 0 = the artifact's rule (3, or 6 above 30 ms).
        num_delegates: int = 0
        queue_depth: int = 1
        # Sim model of comm=inline: fifo = a depth-1 FIFO (Megatron's async P2P on GPU, the paper
        # figures); blocking = the send holds the compute stream until delivered (this repo's CPU
        # runtime, which sleeps the delay and sends on the compute thread; fidelity/pipeline).
        inline_model: str = "fifo"
        # Sim order of a run of consecutive SEND/RECV actions on a stage: batch = posted as one
        # batch, sends first (Megatron's batch_isend_irecv; the paper figures); schedule = one
        # by one in schedule order, a RECV holding the stream until its message is there (this
        # repo's runtime trainer, whose receives block the compute thread; fidelity/pipeline).
        p2p_order: str = "batch"
        cpu_penalty: float = 1.15
        steps_per_op: int = 30
        # Write a Chrome trace and a timeline PNG of the slowest simulated iteration.
        timeline: bool = True
        # Sim: what to do about a slow data-parallel link: 'ignore' or 'remap' it into a
        # pipeline link once detected (as the paper does).
        dp_link_policy: str = "ignore"
        # Sim: DDP gradient bucket. Default: Megatron-LM's 40M elements x 2 bytes (fp16); the
        # artifact is a Megatron fork (PyTorch DDP would be 25 MB).
        bucket_bytes: float = 80e6
        # Sim: one-time cost of remapping ranks (rebuild communicators, move one stage's
        # states) [R], and of a checkpoint-restart (default 5 min [R]; impl/adaptra/README.md).
        remap_cost_s: float = 10.0
        restart_cost_s: float = 300.0
        # the dp_link_policy values this system runs (a subclass with its own mitigation overrides it)
        DP_POLICIES: ClassVar[tuple[str, ...]] = DP_LINK_POLICIES.names()

        def __post_init__(self):
            SCHEDULES.get(self.schedule)
            COMMS.get(self.comm)
            for field, allowed in (("delegate_when", DELEGATE_WHEN), ("adapt_formula", ("paper", "artifact")),
                                   ("p2p_order", P2P_ORDERS)):
                value = getattr(self, field)
                if value not in allowed:
                    raise ConfigError(f"system.{field}: unknown value {value!r} (one of: {', '.join(allowed)})")
            INLINE_MODELS.get(self.inline_model)
            if self.queue_depth < 1:
                raise ConfigError(f"system.queue_depth must be >= 1, got {self.queue_depth}")
            if self.num_delegates < 0:
                raise ConfigError(f"system.num_delegates must be >= 0 (0 = automatic), got {self.num_delegates}")
            if self.dp_link_policy not in self.DP_POLICIES:
                raise ConfigError(f"system.dp_link_policy: unknown value {self.dp_link_policy!r} "
                                  f"(one of: {', '.join(self.DP_POLICIES)})")
            if not self.bucket_bytes > 0:
                raise ConfigError(f"system.bucket_bytes must be > 0, got {self.bucket_bytes}")
            for field in ("remap_cost_s", "restart_cost_s"):
                if not getattr(self, field) >= 0:
                    raise ConfigError(f"system.{field} must be >= 0 seconds, got {getattr(self, field)}")

    # ---- shared by both modes -------------------------------------------------------------
    def _delegates(self, job: JobContext, max_delay_s: float) -> int:
        n = job.workload.num_microbatches
        from impl.common.runtime.executor import default_num_delegates

        k = self.cfg.num_delegates or default_num_delegates(max_delay_s)
        if n % k:
            raise ConfigError(f"workload.num_microbatches {n} is not divisible by delegate count {k} "
                              f"(system.num_delegates)")
        return k

    def _uses_delegates(self, detected: dict) -> bool:
        if not COMMS.get(self.cfg.comm).delegated:
            return False
        return self.cfg.delegate_when == "always" or any(v > 0 for v in detected.values())

    def _compute_schedule(self, tF, tB, tW, detected: dict, S: int, N: int) -> tuple[Schedule, Optional[list]]:
        return SCHEDULES.get(self.cfg.schedule).plan(self.cfg, tF, tB, tW, detected, S, N)

    def check(self, mode, wl, hardware, fault) -> None:
        from impl.common.workloads.hybrid import as_pipeline

        wl = as_pipeline(wl)
        if getattr(wl, "kind", None) != "pipeline":
            raise ConfigError(f"workload.kind: system {self.name!r} trains a pipeline; got workload kind {wl.kind!r}")
        if wl.stages < 1 or wl.num_microbatches < 1:
            raise ConfigError(f"workload.stages ({wl.stages}) and workload.num_microbatches "
                              f"({wl.num_microbatches}) must be >= 1")
        if fault.kind not in self.SUPPORTED_FAULTS:
            raise ConfigError(f"fault.kind: system {self.name!r} does not support fault {fault.kind!r} "
                              f"(supports: {', '.join(self.SUPPORTED_FAULTS)})")
        validate_link_delay(fault, wl.stages)
        validate_dp_link_delay(fault, wl.stages, wl.dp)
        validate_varying_link_delay(fault, wl.stages)
        if fault.kind == "compute_slowdown":
            from impl.common.fault_model.compute_slowdown import validate_compute_slowdown

            validate_compute_slowdown(fault, wl.stages * wl.dp * wl.tp)
            if fault.trace:
                raise ConfigError(f"fault.trace: system {self.name!r} prices a static slow GPU only (gpus/factor), "
                                  f"not a slowdown trace")
        if fault.kind == "dp_link_delay" and wl.sim_op_time_s:
            raise ConfigError("fault.kind dp_link_delay needs gradient sizes from the model shape; "
                              "workload.sim_op_time_s must be null")
        if mode == "real" and fault.kind == "compute_slowdown":
            if wl.dp != 1 or wl.tp != 1:
                raise ConfigError(f"fault.kind compute_slowdown: real mode runs one pipeline of TP 1 "
                                  f"(dp={wl.dp}, tp={wl.tp})")
            if wl.op_pad_s <= 0:
                raise ConfigError("fault.kind compute_slowdown: real mode stretches the padded op time of the slow "
                                  "GPU's stage; set workload.op_pad_s > 0")
        if mode != "sim" and (fault.kind in SIM_ONLY_FAULTS or getattr(fault, "rnic_failure_iters", None)):
            what = "fault.rnic_failure_iters" if fault.kind == "link_delay" else f"fault.kind {fault.kind}"
            raise ConfigError(f"{what} exists only in sim mode (mode={mode})")
        if fault.kind == "rank_kill" and mode != "real":
            raise ConfigError("fault.kind rank_kill: only a real run has ranks to kill (mode=real)")
        if COMMS.get(self.cfg.comm).delegated and wl.num_microbatches % self._delegate_count(fault):
            k = self._delegate_count(fault)
            raise ConfigError(f"workload.num_microbatches {wl.num_microbatches} is not divisible by delegate "
                              f"count {k} (system.num_delegates)")
        if mode == "real":
            if COMMS.get(self.cfg.comm).runtime is None:
                real = ", ".join(name for name, path in COMMS.items() if path.runtime is not None)
                raise ConfigError(f"system.comm: {self.cfg.comm!r} exists only in sim mode (real: {real})")
            if SCHEDULES.get(self.cfg.schedule).real_planner is not None and wl.op_pad_s <= 0:
                raise ConfigError(f"workload.op_pad_s: the {self.cfg.schedule} schedule in real mode plans with the "
                                  "padded op time; set it > 0 (the CPU link-delay experiment uses 20 ms)")

    def _delegate_count(self, fault) -> int:
        """Delegates per direction over the whole run: the knob, or the artifact's rule applied
        to the largest delay the fault can inject."""
        from impl.common.runtime.executor import default_num_delegates

        if self.cfg.num_delegates:
            return self.cfg.num_delegates
        delays = [getattr(fault, "delay_s", 0.0)]
        delays += [ev.delay_s for ev in getattr(fault, "trace", []) or []]
        flat = [d for x in delays for d in (x if isinstance(x, (list, tuple)) else [x])]
        return default_num_delegates(max(flat + [0.0]))

    def run(self, job: JobContext) -> RunResult:
        from impl.common.workloads.hybrid import as_pipeline

        job = dataclasses.replace(job, workload=as_pipeline(job.workload))
        self.check(job.mode, job.workload, job.hardware, job.fault)
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
            # Hand-set op times (the "t = 10 ms" simulator reference [R], impl/adaptra/README.md): comm is free except delays,
            # unless the profile is this machine's calibration (a fidelity job), whose links are real.
            links = (LinkCosts.from_hardware(wl.stages, msg, job.hardware, tp=wl.tp, dp=wl.dp)
                     if job.hardware.measured else LinkCosts.uniform(wl.stages, 0.0, msg))
            return StageCosts.uniform(wl.stages, wl.sim_op_time_s), links
        costs = stage_costs(wl.model, wl.stages, wl.micro_batch_size, wl.dtype, wl.tp, job.hardware)
        return costs, LinkCosts.from_hardware(wl.stages, msg, job.hardware, tp=wl.tp, dp=wl.dp)

    @property
    def _batch_p2p(self) -> bool:
        return self.cfg.p2p_order == "batch"

    def _stream_comm(self):
        return COMMS.get(self.cfg.comm).stream(self.cfg)

    def _mitigation(self, job: JobContext):
        return DP_LINK_POLICIES.get(self.cfg.dp_link_policy)(self.cfg, job)

    def _dp_allreduce(self, job: JobContext):
        """``(grad bytes per stage, hardware, ranks per node)`` of the stage gradient all-reduce,
        or None when there is none (dp = 1, or hand-set op times without a model).

        A stage's DP group is ``dp`` ranks ``tp`` apart (placement in impl.common.cost.comm),
        priced by impl.common.collectives (one NIC per ring once there is one rank per node).
        """
        from impl.common.cost.transformer import stage_grad_bytes

        wl, hw = job.workload, job.hardware
        if wl.dp <= 1 or wl.sim_op_time_s:
            return None
        from impl.common.collectives import group_ranks_per_node

        k = group_ranks_per_node(wl.dp, wl.tp, hw.gpus_per_node)
        return stage_grad_bytes(wl.model, wl.stages, wl.dtype, wl.tp), hw, k

    def _per_iteration_s(self, job: JobContext) -> float:
        """The step model's per-iteration terms (:func:`impl.common.megatron.step.optimizer_step_s`,
        one rule for every training system): Adam over the largest stage's parameters on one TP
        rank (a DP all-reduce, no optimizer sharding) and ``iteration_overhead_s``. Hand-set op
        times (the paper's simulator reference) price no step model, so nothing is added there."""
        from impl.common.cost.transformer import bytes_per_elem, stage_grad_bytes
        from impl.common.megatron.step import optimizer_step_s

        wl = job.workload
        if wl.sim_op_time_s:
            return 0.0
        params = max(stage_grad_bytes(wl.model, wl.stages, wl.dtype, wl.tp)) / bytes_per_elem(wl.dtype)
        return optimizer_step_s(params, 1, job.hardware)

    def _dp_times(self, dp_spec, dp: int, slow: dict) -> Optional[tuple]:
        from impl.adaptra.mitigate import bucketed_allreduce_s

        if dp_spec is None:
            return None
        grads, hw, k = dp_spec
        return tuple(bucketed_allreduce_s(g, dp, hw, k, self.cfg.bucket_bytes, slow.get(s, 0.0))
                     for s, g in enumerate(grads))

    def _run_sim(self, job: JobContext) -> RunResult:
        from impl.adaptra.mitigate import remap_link
        from impl.common.sim.pipeline import CommModel, simulate_iteration

        wl, fault = job.workload, job.fault
        S, N = wl.stages, wl.num_microbatches
        costs, link = self._costs(job)
        tF, tB, tW = list(costs.tf_s), list(costs.tb_s), list(costs.tw_s)
        if fault.kind == "compute_slowdown":
            from impl.common.fault_model.compute_slowdown import slowdown_at

            per_stage = wl.dp * wl.tp
            x = slowdown_at(fault, 0, S * per_stage)
            slow = [max(x[s * per_stage:(s + 1) * per_stage]) for s in range(S)]
            tF, tB, tW = ([t * f for t, f in zip(ts, slow)] for ts in (tF, tB, tW))
            costs = dataclasses.replace(costs, tf_s=tuple(tF), tb_s=tuple(tB), tw_s=tuple(tW))
        iters = wl.warmup_iterations + wl.iterations
        detection = getattr(fault, "detection", "oracle")
        timeline = DelayTimeline(fault, S) if fault.kind == "varying_link_delay" else None
        rnic_failures = set(getattr(fault, "rnic_failure_iters", None) or [])
        dp_spec = self._dp_allreduce(job)
        per_iter_s = self._per_iteration_s(job)
        ctl = self._mitigation(job)
        sched_cache: dict = {}
        sim_cache: dict = {}
        times, bubbles, hol, dep, plans, events, in_force = [], [], [], [], [], [], []
        overhead_s = 0.0
        origin_s = 0.0  # wall clock of the run (time-varying delays are functions of it)
        prev_pp: dict = {}  # the previous iteration's pipeline-link delays (measured detection)
        prev_window = None
        failed_over = False
        worst = None
        for it in range(iters):
            # ---- iteration boundary: actions decided so far take effect ----------------------
            dp_inj = dp_link_delays_at(fault, it, S)
            new = ctl.boundary(it, dp_inj)
            if it in rnic_failures:
                if COMMS.get(self.cfg.comm).delegated:
                    failed_over = True
                    new.append({"iteration": it, "action": "rnic_failover", "cost_s": 0.0,
                                "why": "RNIC failure: delegates switch NIC"})
                else:
                    new.append({"iteration": it, "action": "restart", "cost_s": self.cfg.restart_cost_s,
                                "why": "RNIC failure: checkpoint-restart"})
            # ---- what is injected this iteration -------------------------------------------
            if ctl.healed:
                dp_inj = {}
            pp = {} if timeline else link_delays_at(fault, it, S)
            remapped_links = {}
            if ctl.remapped and dp_inj:
                for stage, d in dp_inj.items():
                    lk = remap_link(stage, S)
                    remapped_links[lk] = pp[lk] = max(pp.get(lk, 0.0), d)
                dp_inj = {}
            # ---- what the scheduler acts on ------------------------------------------------
            if timeline is not None:
                if detection == "oracle":
                    detected = timeline.table_at(origin_s)
                else:
                    detected = timeline.mean_over(*prev_window) if prev_window else {}
            elif detection == "oracle":
                detected = dict(pp)
            else:
                # One iteration of lag; a remapped link's delay is known from the profiling that found it.
                detected = {**prev_pp, **remapped_links}
            delegated = COMMS.get(self.cfg.comm).delegated and (failed_over or self._uses_delegates(detected))
            if delegated:
                max_delay = max(list(detected.values()) + [0.0])
                comm = CommModel(kind="delegated", delegates=self._delegates(job, max_delay),
                                 cpu_penalty=self.cfg.cpu_penalty, batch_p2p=self._batch_p2p)
            else:
                comm = self._stream_comm()
            plan_key = tuple(sorted(detected.items())) if SCHEDULES.get(self.cfg.schedule).delay_aware else ()
            if plan_key not in sched_cache:
                sched, warmup = self._compute_schedule(tF, tB, tW, dict(plan_key), S, N)
                sched_cache[plan_key] = (insert_comm(sched), warmup)
            sched, warmup = sched_cache[plan_key]
            dp_s = self._dp_times(dp_spec, wl.dp, dp_inj)
            if timeline is not None:
                res = simulate_iteration(sched, costs, link, comm, delays=timeline.delay, dp_allreduce_s=dp_s,
                                         origin_s=origin_s)
            else:
                key = (plan_key, tuple(sorted(pp.items())), comm, dp_s)
                if key not in sim_cache:
                    sim_cache[key] = simulate_iteration(sched, costs, link, comm, delays=pp, dp_allreduce_s=dp_s)
                res = sim_cache[key]
            T = res.iteration_time_s + per_iter_s
            action_now = "rnic_failover" if failed_over and ctl.in_force == "none" else ctl.in_force
            ctl.observe(it, T, dp_link_delays_at(fault, it, S) if not ctl.healed else {})
            one_time = sum(e["cost_s"] for e in new)
            prev_pp, prev_window = pp, (origin_s + one_time, origin_s + one_time + T)
            origin_s += one_time + T
            if it < wl.warmup_iterations:
                continue
            events += new
            overhead_s += one_time
            times.append(T)
            in_force.append(action_now)
            bubbles.append(res.bubble_fraction())
            hol.append(sum(b.hol_s for b in res.breakdown) / (S * res.iteration_time_s))
            dep.append(sum(b.dependency_s for b in res.breakdown) / (S * res.iteration_time_s))
            if len(plans) < 20:
                plans.append({"iteration": it, "delays_s": {f"{a}-{b}": v for (a, b), v in detected.items()}
                              if timeline is not None else {f"{a}-{b}": v for (a, b), v in pp.items()},
                              "dp_delays_s": {str(k): v for k, v in dp_inj.items()},
                              "warmup": warmup, "comm": comm.kind,
                              "delegates": comm.delegates if comm.kind == "delegated" else 0})
            if worst is None or res.iteration_time_s > worst.iteration_time_s:
                worst = res
        # The same policy with no delay at all: the denominator of the paper's "slowdown".
        sched0, _ = self._compute_schedule(tF, tB, tW, {}, S, N)
        comm0 = (CommModel(kind="delegated", delegates=self._delegates(job, 0.0), cpu_penalty=self.cfg.cpu_penalty,
                           batch_p2p=self._batch_p2p)
                 if COMMS.get(self.cfg.comm).delegated and self.cfg.delegate_when == "always"
                 else self._stream_comm())
        t0 = simulate_iteration(insert_comm(sched0), costs, link, comm0,
                                dp_allreduce_s=self._dp_times(dp_spec, wl.dp, {})).iteration_time_s + per_iter_s
        samples_per_iter = wl.micro_batch_size * N * max(wl.dp, 1)
        total_s = math.fsum(times) + overhead_s
        tail = times[-max(1, len(times) // 4):]
        metrics = {
            "iteration_time_s": Metric.from_samples(times, "s", "lower"),
            "mean_iteration_time_s": Metric.scalar(math.fsum(times) / len(times), "s", "lower"),
            "steady_iteration_time_s": Metric.from_samples(tail, "s", "lower"),
            "total_time_s": Metric.scalar(total_s, "s", "lower"),
            "total_time_min": Metric.scalar(total_s / 60.0, "min", "lower"),
            "one_time_costs_s": Metric.scalar(overhead_s, "s", "lower"),
            "throughput_samples_per_s": Metric.scalar(samples_per_iter * len(times) / total_s, "samples/s", "higher"),
            "slowdown_vs_no_delay": Metric.from_samples([t / t0 for t in times], "x", "lower"),
            "bubble_fraction": Metric.from_samples(bubbles, "fraction", "lower"),
            "hol_share": Metric.from_samples(hol, "fraction", "lower"),
            "dependency_bubble_share": Metric.from_samples(dep, "fraction", "lower"),
        }
        runs = []  # the action in force, run-length encoded: one entry per change
        for k, action in enumerate(in_force):
            if not runs or runs[-1]["action"] != action:
                runs.append({"from_iteration": wl.warmup_iterations + k, "action": action})
        info = {
            "schedule": self.cfg.schedule, "comm": self.cfg.comm, "adapt_formula": self.cfg.adapt_formula,
            "detection": detection, "no_delay_iteration_time_s": t0, "per_iteration_s": per_iter_s,
            "op_times_s": {"tF": tF[0], "tB": tB[0], "tW": tW[0]} if len(set(tF)) == 1 else {"tF": tF, "tB": tB, "tW": tW},
            "plans": plans, "distinct_plans": len(sched_cache), "distinct_simulations": len(sim_cache),
            "events": events, "mitigation": ctl.info(), "action_in_force": runs,
            "iteration_times_s": [round(t, 9) for t in times]}
        if dp_spec is not None:
            info["dp_allreduce_no_delay_s"] = list(self._dp_times(dp_spec, wl.dp, {}))
            info["bucket_bytes"] = self.cfg.bucket_bytes
        result = RunResult(metrics=metrics, info=info)
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
        from impl.adaptra.milp_gap import scheduler_gap

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
