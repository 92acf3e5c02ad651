"""Multi-process pipeline executor: S trainer ranks run a schedule on the tiny GPT.

``run_pipeline`` takes a :class:`PipelineJob` (validated when built) and
:class:`LaunchOptions`, then starts one rank per stage through
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
__all__ = ["COMMS", "FixedSchedule", "LaunchOptions", "NamedSchedule", "PerIterationSchedule", "PipelineJob", "RunStats",
           "default_num_delegates", "prepare_schedule", "run_pipeline"]

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


@dataclass
class PipelineJob:
    """What a pipeline run trains and under which conditions; validates itself when built.

    ``schedule_fn(iteration, {(i, i+1): seconds}) -> Schedule`` is called by every rank at
    every iteration start with the delays the scheduler may know (see ``detection``);
    compute-only schedules get SEND/RECV inserted. ``comm``: 'inline' | 'fifo' (alias
    'in_stream') | 'delegated'. ``delays``: a LinkDelay fault or a fixed ``{link: seconds}``
    table. ``delegate_when='on_delay'`` uses the FIFO path until the scheduler sees a delay.
    ``slowdown``: a factor per rank on its padded op time (a static slow GPU; needs ``op_pad_s``).
    ``shape``, ``iterations`` and ``warmup`` default to the workload's. Raises ConfigError for
    bad inputs, so nothing starts on them.
    """

    schedule_fn: ScheduleFn
    workload: Optional[PipelineWorkload]
    shape: Optional[ModelShape] = None
    comm: str = "inline"
    delays: Union[None, LinkDelay, Mapping[Link, float]] = None
    detection: Optional[str] = None
    num_delegates: Optional[int] = None
    delegate_when: str = "always"
    fifo_depth: int = 1
    iterations: Optional[int] = None
    warmup: Optional[int] = None
    seed: int = 0
    op_pad_s: float = 0.0
    optimizer: str = "sgd"
    lr: float = 0.1
    kill_at: Optional[tuple[int, int]] = None
    slowdown: Optional[Sequence[float]] = None

    def __post_init__(self) -> None:
        wl = self.workload
        if wl is None:
            raise ConfigError("workload: run_pipeline needs a PipelineWorkload "
                              "(stages, num_microbatches, micro_batch_size)")
        self.shape = self.shape or wl.model
        S, N = wl.stages, wl.num_microbatches
        validate_shape(self.shape, S)
        if N < 1 or wl.micro_batch_size < 1:
            raise ConfigError(f"workload.num_microbatches ({N}) and workload.micro_batch_size "
                              f"({wl.micro_batch_size}) must be >= 1")
        self.comm = _COMM_ALIASES.get(self.comm, self.comm)
        if self.comm not in COMMS:
            raise ConfigError(f"comm: unknown value {self.comm!r} (one of: inline, fifo, delegated)")
        if self.delegate_when not in ("always", "on_delay"):
            raise ConfigError(f"delegate_when: unknown value {self.delegate_when!r} (one of: always, on_delay)")
        self.iterations = wl.iterations if self.iterations is None else self.iterations
        self.warmup = wl.warmup_iterations if self.warmup is None else self.warmup
        if self.iterations < 1 or self.warmup < 0:
            raise ConfigError(f"iterations ({self.iterations}) must be >= 1 and warmup ({self.warmup}) >= 0")
        if self.op_pad_s < 0:
            raise ConfigError(f"op_pad_s: must be >= 0, got {self.op_pad_s}")
        if self.fifo_depth < 1:
            raise ConfigError(f"fifo_depth: must be >= 1, got {self.fifo_depth}")
        total = self.warmup + self.iterations
        if self.kill_at is not None:
            if not (0 <= self.kill_at[0] < S and 0 <= self.kill_at[1] < total):
                raise ConfigError(f"fault.rank {self.kill_at[0]} / fault.at_iter {self.kill_at[1]}: the run has ranks "
                                  f"0..{S - 1} and iterations 0..{total - 1}")
            self.kill_at = (int(self.kill_at[0]), int(self.kill_at[1]))
        if self.slowdown is not None:
            self.slowdown = tuple(float(x) for x in self.slowdown)
            if len(self.slowdown) != S or min(self.slowdown) < 1.0:
                raise ConfigError(f"slowdown: one factor >= 1 per rank ({S}), got {list(self.slowdown)}")
            if self.op_pad_s <= 0 and max(self.slowdown) > 1.0:
                raise ConfigError("slowdown: a slow rank stretches its padded op time; set op_pad_s > 0")

    @property
    def stages(self) -> int:
        return self.workload.stages

    @property
    def total_iterations(self) -> int:
        return self.warmup + self.iterations


@dataclass(frozen=True)
class LaunchOptions:
    """How a pipeline run's processes start, talk, check their work and report."""

    backend: Optional[str] = None  # None: NCCL when each stage can have a GPU, else gloo
    start_method: str = "forkserver"
    pg_timeout_s: float = 120.0  # a hung collective ends in an error after this
    timeout_s: float = 900.0  # the whole run
    verify_checksums: bool = True
    validate: bool = True  # validate every schedule a rank gets
    progress: bool = False


def run_pipeline(job: PipelineJob, options: Optional[LaunchOptions] = None) -> RunStats:
    """Run ``job.warmup + job.iterations`` training iterations of the tiny GPT on S processes.

    Raises ConfigError for bad inputs (before starting anything) and RuntimeError naming the
    failing rank if a worker fails.
    """
    options = options or LaunchOptions()
    controller = LinkDelayController(job.delays, job.stages, job.detection)
    K = _delegate_count(job, controller)
    backend = choose_backend(options.backend, local_world(job.stages))
    _check_first_schedule(job, controller, options.validate)
    cfg = _trainer_config(job, controller, K, options)
    channels, helpers = _local_delegates(job, K, options)
    run = _launch_ranks(job, cfg, channels, helpers, backend, options)
    counts = dict(run.helpers)
    pids = list(run.pids)
    for r in run.results:
        counts.update(r["delegate_messages"])
        pids += r["delegate_pids"]
    return collect(run.results, cfg, K, backend, "cuda" if backend == "nccl" else "cpu", pids,
                   options.start_method, counts)


def _delegate_count(job: PipelineJob, controller: LinkDelayController) -> int:
    """Delegates per (stage, direction) on the delegated path (0 on the others)."""
    if job.comm != "delegated":
        return 0
    K = job.num_delegates or default_num_delegates(controller.max_delay_s(job.total_iterations))
    if K < 1:
        raise ConfigError(f"num_delegates: must be >= 1, got {K}")
    N = job.workload.num_microbatches
    if N % K:
        raise ConfigError(f"workload.num_microbatches {N} is not divisible by delegate count {K} (num_delegates)")
    return K


def _check_first_schedule(job: PipelineJob, controller: LinkDelayController, validate: bool) -> None:
    """Build and check iteration 0's schedule here, before any process starts: bad input fails in one line."""
    S = job.stages
    first_delays = controller.delays_at(0) if controller.detection == "oracle" else dict.fromkeys(all_links(S), 0.0)
    prepare_schedule(job.schedule_fn(0, dict(first_delays)), S, job.workload.num_microbatches,
                     blocking_sends=job.comm == "inline", validate=validate)


def _trainer_config(job: PipelineJob, controller: LinkDelayController, K: int, options: LaunchOptions) -> TrainerConfig:
    wl = job.workload
    return TrainerConfig(job.schedule_fn, job.shape, wl.stages, wl.num_microbatches, wl.micro_batch_size, job.comm,
                         job.delegate_when, job.fifo_depth, controller, job.iterations, job.warmup, job.seed,
                         job.op_pad_s, job.optimizer, job.lr, options.pg_timeout_s, options.verify_checksums,
                         max(1, wl.torch_threads), options.validate, K, job.kill_at, job.slowdown)


def _local_delegates(job: PipelineJob, K: int, options: LaunchOptions):
    """Shared channels and the delegate processes' start, owned by this process for a local
    delegated run, so nothing is orphaned if a trainer dies. Under torchrun each trainer
    starts its own side: ``({}, None)``, as on the other comm paths."""
    if job.comm != "delegated" or under_torchrun():
        return {}, None
    from impl.common.runtime.delegated import delegate_helpers, make_delegate_channels

    wl, shape = job.workload, job.shape
    spec = MessageSpec((wl.micro_batch_size, shape.seq_len, shape.hidden), torch.float32)
    channels = make_delegate_channels(mp_context(options.start_method, _PRELOAD), wl.stages, K,
                                      wl.num_microbatches, spec)
    return channels, lambda addr: delegate_helpers(channels, addr, options.pg_timeout_s)


def _launch_ranks(job: PipelineJob, cfg: TrainerConfig, channels: dict, helpers, backend: str,
                  options: LaunchOptions):
    """One trainer process per stage (plus the delegates), a progress bar fed by their reports."""
    S, N, kill_at = job.stages, job.workload.num_microbatches, job.kill_at
    bar = None
    if options.progress:
        from tqdm import tqdm

        bar = tqdm(total=job.total_iterations, desc=f"real pipeline S={S} N={N} ({job.comm})", unit="it",
                   leave=False)

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
        return launch(trainer_main, S, (cfg, channels or None), label="pipeline", backend=backend,
                      pg_timeout_s=options.pg_timeout_s, timeout_s=options.timeout_s,
                      start_method=options.start_method, preload=_PRELOAD, on_report=on_report, helpers=helpers,
                      stop_helpers=stop_helpers if channels else None, describe_death=describe_death,
                      victim=None if kill_at is None else f"rank {kill_at[0]}")
    finally:
        if bar is not None:
            bar.close()
