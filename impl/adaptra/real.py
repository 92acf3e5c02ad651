"""Real mode of the ADAPTRA family: S local processes run the schedule on a tiny GPT.

Ops are sleep-padded to ``workload.op_pad_s`` so that a 2-core CPU behaves
like a pipeline of equal stages; raw compute is reported beside the padded time (our CPU
link-delay experiment [R], impl/adaptra/README.md, "Reconstructed choices").
"""
from __future__ import annotations

from impl.adaptra.policies import COMMS, SCHEDULES
from impl.common.api import JobContext, Metric, RunResult

MIN_MEASURED_ITERATIONS = 3


def _stage_slowdown(fault, wl):
    """A static slow GPU as a factor per stage: every op of a stage runs at its slowest
    replica's factor (as the sim prices it); real mode runs dp = tp = 1, so GPU g is stage g."""
    if getattr(fault, "kind", None) != "compute_slowdown":
        return None
    from impl.common.fault_model.compute_slowdown import slowdown_at

    x = slowdown_at(fault, 0, wl.stages * wl.dp * wl.tp)
    per = wl.dp * wl.tp
    return [max(x[s * per:(s + 1) * per]) for s in range(wl.stages)]


def run_real(system, job: JobContext) -> RunResult:
    from impl.common.runtime.executor import LaunchOptions, NamedSchedule, PipelineJob, run_pipeline

    cfg, wl = system.cfg, job.workload
    # system.check has vetted comm, op_pad_s and the fault before we get here.
    planner = SCHEDULES.get(cfg.schedule).real_planner
    schedule_fn = (planner(cfg, wl) if planner is not None
                   else NamedSchedule(cfg.schedule, wl.stages, wl.num_microbatches))
    slowdown = _stage_slowdown(job.fault, wl)
    pipeline = PipelineJob(schedule_fn, wl, comm=COMMS.get(cfg.comm).runtime, delays=job.fault
                           if job.fault.kind == "link_delay" else None, seed=job.seed,
                           num_delegates=cfg.num_delegates or None, op_pad_s=wl.op_pad_s,
                           fifo_depth=cfg.queue_depth, delegate_when=cfg.delegate_when,
                           detection=getattr(job.fault, "detection", None),
                           kill_at=(job.fault.rank, job.fault.at_iter) if job.fault.kind == "rank_kill" else None,
                           slowdown=slowdown)
    stats = run_pipeline(pipeline, LaunchOptions(progress=job.show_progress))
    times = stats.iteration_times_s
    samples = wl.micro_batch_size * wl.num_microbatches
    raw = {op: stats.mean_raw_op_s(op) for op in ("F", "B", "W", "BW")}
    metrics = {
        "iteration_time_s": Metric.from_samples(times, "s", "lower"),
        "throughput_samples_per_s": Metric.from_samples([samples / t for t in times], "samples/s", "higher"),
        "send_wait_s": Metric.scalar(sum(stats.send_wait_s.values()) / max(len(times), 1), "s/iteration", "lower"),
        "final_loss": Metric.scalar(sum(stats.losses[-1]) / len(stats.losses[-1]), "nats", "lower"),
    }
    for op, value in raw.items():
        if value == value and value > 0:  # ops this schedule does not run report nan/0
            metrics[f"raw_{op.lower()}_compute_s"] = Metric.scalar(value, "s/op", "lower")
    result = RunResult(metrics=metrics, info={
        "schedule": cfg.schedule, "comm": cfg.comm, "comm_paths": stats.comm_paths, "backend": stats.backend,
        "device": stats.device, "num_delegates": stats.num_delegates, "detection": stats.detection,
        "adapt_formula": cfg.adapt_formula, "op_pad_s": wl.op_pad_s, "params_sha256": stats.params_digest,
        "injected_delays_s": stats.injected_delays_s, "scheduler_delays_s": stats.scheduler_delays_s,
        "estimated_delays_s": stats.estimated_delays_s, "messages_per_iteration": stats.messages[-1] if stats.messages else {},
        "peak_in_flight": {str(k): v for k, v in stats.peak_in_flight.items()},
        "distinct_schedules": len(stats.schedules), "losses_last_iteration": stats.losses[-1]})
    if slowdown is not None:
        result.emulated.append(f"slow GPU: its stage's padded op time x {max(slowdown)} "
                               "(sleep; the GPU itself is not slowed)")
    if wl.op_pad_s > 0:
        result.emulated.append(f"every F/B/W op padded with sleep to {wl.op_pad_s * 1e3:g} ms; "
                               "raw compute is reported as raw_*_compute_s")
    if stats.device == "cpu" and "delegated" in stats.comm_paths:
        result.emulated.append("delegated path: host<->device copies are CPU memcpy (no GPU present)")
    if len(times) < MIN_MEASURED_ITERATIONS:
        result.mark_invalid(f"only {len(times)} measured iterations (< {MIN_MEASURED_ITERATIONS})")
    return result
