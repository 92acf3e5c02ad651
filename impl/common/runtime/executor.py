"""Multi-process pipeline executor: S trainer ranks run a schedule on the tiny GPT.

``run_pipeline`` validates the job, then starts one rank per stage through
:func:`impl.common.runtime.launch.launch` (local processes, or torchrun's ranks across
hosts; gloo on CPU, NCCL + one GPU per stage when enough GPUs are visible), plus the delegate
processes of the delegated comm path. What each rank does per iteration is in
:mod:`impl.common.runtime.trainer`; what comes back is :class:`~impl.common.runtime.run_stats.RunStats`.

Errors: a rank that raises ends the run with one line naming it; the launcher stops every
other process. Process groups carry a timeout so a hung collective also ends in an error
rather than a hang.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch

from impl.common.fault_model.spec import LinkDelay
from impl.common.api import ConfigError
from impl.common.models.tiny_gpt import validate_shape
from impl.common.runtime.comm import MessageSpec
from impl.common.runtime.launch import choose_backend, launch, local_world, mp_context, under_torchrun
from impl.common.runtime.link_delay import Link, LinkDelayController, all_links
from impl.common.runtime.run_stats import RunStats, collect
from impl.common.runtime.trainer import ScheduleFn, TrainerConfig, prepare_schedule, trainer_main
from impl.common.schedule.ir import Schedule
from impl.common.workloads.pipeline import ModelShape, PipelineWorkload

COMMS = ("inline", "fifo", "delegated")
_COMM_ALIASES = {"in_stream": "fifo"}
_PRELOAD = ["impl.common.runtime.executor"]
__all__ = ["COMMS", "FixedSchedule", "NamedSchedule", "PerIterationSchedule", "RunStats", "default_num_delegates",
           "prepare_schedule", "run_pipeline"]

# ---------------------------------------------------------------------------------------
# schedule providers (picklable, so they can travel to the worker processes)
# ---------------------------------------------------------------------------------------


@dataclass
class FixedSchedule:
    """The same schedule every iteration."""

    schedule: Schedule

    def __call__(self, iteration: int, delays: dict) -> Schedule:
        return self.schedule


@dataclass
class PerIterationSchedule:
    """``schedules[i]`` at iteration i (the last one from then on): schedule switches."""

    schedules: list

    def __call__(self, iteration: int, delays: dict) -> Schedule:
        return self.schedules[min(iteration, len(self.schedules) - 1)]


@dataclass
class NamedSchedule:
    """A baseline from :func:`impl.common.schedule.generators.generate` (delay-blind)."""

    name: str
    num_stages: int
    num_microbatches: int

    def __call__(self, iteration: int, delays: dict) -> Schedule:
        from impl.common.schedule.generators import generate

        return generate(self.name, self.num_stages, self.num_microbatches)



def default_num_delegates(max_delay_s: float) -> int:
    """The artifact's rule (wutianyuan1/PipeMorph, branch `AE`): K = 3 for delays <= 30 ms, else 6."""
    return 3 if max_delay_s <= 0.030 else 6




def run_pipeline(schedule_fn: ScheduleFn, shape: Optional[ModelShape] = None,
                 workload: Optional[PipelineWorkload] = None, comm: str = "inline",
                 delays: Union[None, LinkDelay, Mapping[Link, float]] = None,
                 iterations: Optional[int] = None, warmup: Optional[int] = None, seed: int = 0,
                 num_delegates: Optional[int] = None, op_pad_s: float = 0.0, backend: Optional[str] = None, *,
                 optimizer: str = "sgd", lr: float = 0.1, detection: Optional[str] = None,
                 fifo_depth: int = 1, delegate_when: str = "always", pg_timeout_s: float = 120.0,
                 timeout_s: float = 900.0, start_method: str = "forkserver", verify_checksums: bool = True,
                 validate: bool = True, progress: bool = False,
                 kill_at: Optional[tuple[int, int]] = None,
                 slowdown: Optional[Sequence[float]] = None) -> RunStats:
    """Run ``warmup + iterations`` training iterations of the tiny GPT on S processes.

    ``schedule_fn(iteration, {(i, i+1): seconds}) -> Schedule`` is called by every rank at
    every iteration start with the delays the scheduler may know (see ``detection``);
    compute-only schedules get SEND/RECV inserted. ``comm``: 'inline' | 'fifo' (alias
    'in_stream') | 'delegated'. ``delays``: a LinkDelay fault or a fixed ``{link: seconds}``
    table. ``delegate_when='on_delay'`` uses the FIFO path until the scheduler sees a delay.
    ``slowdown``: a factor per rank on its padded op time (a static slow GPU; needs ``op_pad_s``).
    Raises ConfigError for bad inputs (before starting anything) and RuntimeError naming the
    failing rank if a worker fails.
    """
    if workload is None:
        raise ConfigError("workload: run_pipeline needs a PipelineWorkload "
                          "(stages, num_microbatches, micro_batch_size)")
    shape = shape or workload.model
    S, N = workload.stages, workload.num_microbatches
    validate_shape(shape, S)
    if N < 1 or workload.micro_batch_size < 1:
        raise ConfigError(f"workload.num_microbatches ({N}) and workload.micro_batch_size "
                          f"({workload.micro_batch_size}) must be >= 1")
    comm = _COMM_ALIASES.get(comm, comm)
    if comm not in COMMS:
        raise ConfigError(f"comm: unknown value {comm!r} (one of: inline, fifo, delegated)")
    if delegate_when not in ("always", "on_delay"):
        raise ConfigError(f"delegate_when: unknown value {delegate_when!r} (one of: always, on_delay)")
    iterations = workload.iterations if iterations is None else iterations
    warmup = workload.warmup_iterations if warmup is None else warmup
    if iterations < 1 or warmup < 0:
        raise ConfigError(f"iterations ({iterations}) must be >= 1 and warmup ({warmup}) >= 0")
    if op_pad_s < 0:
        raise ConfigError(f"op_pad_s: must be >= 0, got {op_pad_s}")
    if fifo_depth < 1:
        raise ConfigError(f"fifo_depth: must be >= 1, got {fifo_depth}")
    if kill_at is not None and not (0 <= kill_at[0] < S and 0 <= kill_at[1] < warmup + iterations):
        raise ConfigError(f"fault.rank {kill_at[0]} / fault.at_iter {kill_at[1]}: the run has ranks 0..{S - 1} "
                          f"and iterations 0..{warmup + iterations - 1}")
    if slowdown is not None:
        slowdown = tuple(float(x) for x in slowdown)
        if len(slowdown) != S or min(slowdown) < 1.0:
            raise ConfigError(f"slowdown: one factor >= 1 per rank ({S}), got {list(slowdown)}")
        if op_pad_s <= 0 and max(slowdown) > 1.0:
            raise ConfigError("slowdown: a slow rank stretches its padded op time; set op_pad_s > 0")
    controller = LinkDelayController(delays, S, detection)
    K = 0
    if comm == "delegated":
        K = num_delegates or default_num_delegates(controller.max_delay_s(warmup + iterations))
        if K < 1:
            raise ConfigError(f"num_delegates: must be >= 1, got {K}")
        if N % K:
            raise ConfigError(f"workload.num_microbatches {N} is not divisible by delegate count {K} (num_delegates)")
    backend = choose_backend(backend, local_world(S))
    # Validate the first schedule here, before any process starts: bad input fails in one line.
    first_delays = controller.delays_at(0) if controller.detection == "oracle" else dict.fromkeys(all_links(S), 0.0)
    prepare_schedule(schedule_fn(0, dict(first_delays)), S, N,
                     blocking_sends=comm == "inline", validate=validate)

    cfg = TrainerConfig(schedule_fn, shape, S, N, workload.micro_batch_size, comm, delegate_when, fifo_depth,
                        controller, iterations, warmup, seed, op_pad_s, optimizer, lr, pg_timeout_s,
                        verify_checksums, max(1, workload.torch_threads), validate, K,
                        None if kill_at is None else (int(kill_at[0]), int(kill_at[1])), slowdown)
    channels: dict = {}
    helpers = None
    if comm == "delegated" and not under_torchrun():
        # Local job: the parent owns the shared channels and the delegates, so nothing is
        # orphaned if a trainer dies. Under torchrun each trainer starts its own side.
        from impl.common.runtime.delegated import delegate_helpers, make_delegate_channels

        spec = MessageSpec((workload.micro_batch_size, shape.seq_len, shape.hidden), torch.float32)
        channels = make_delegate_channels(mp_context(start_method, _PRELOAD), S, K, N, spec)
        helpers = lambda addr: delegate_helpers(channels, addr, pg_timeout_s)  # noqa: E731

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=warmup + iterations, desc=f"real pipeline S={S} N={N} ({comm})", unit="it", leave=False)

    def on_report(rank: int, item) -> None:
        if bar is not None:
            bar.set_postfix_str(f"iteration {item[0]}: {item[1]:.3f} s", refresh=False)
            bar.update(1)

    def describe_death(name: str, exitcode: int):
        if kill_at is not None and name == f"rank {kill_at[0]}":
            return ("InjectedFault", f"killed by the rank_kill fault at iteration {kill_at[1]} (exit code {exitcode})")
        return None

    def stop_helpers() -> None:
        for ch in channels.values():
            ch.request_stop()

    try:
        run = launch(trainer_main, S, (cfg, channels or None), label="pipeline", backend=backend,
                     pg_timeout_s=pg_timeout_s, timeout_s=timeout_s, start_method=start_method, preload=_PRELOAD,
                     on_report=on_report, helpers=helpers, stop_helpers=stop_helpers if channels else None,
                     describe_death=describe_death, victim=None if kill_at is None else f"rank {kill_at[0]}")
    finally:
        if bar is not None:
            bar.close()
    counts = dict(run.helpers)
    pids = list(run.pids)
    for r in run.results:
        counts.update(r["delegate_messages"])
        pids += r["delegate_pids"]
    return collect(run.results, cfg, K, backend, "cuda" if backend == "nccl" else "cpu", pids, start_method, counts)
