"""Multi-process pipeline executor: S trainer processes run a schedule on the tiny GPT.

``run_pipeline`` starts one process per stage (gloo on CPU; NCCL + one GPU per stage when
enough GPUs are visible: same code path, device chosen at start), plus the delegate processes
of the delegated comm path. Each iteration, on every rank:

1. rank 0 publishes the iteration's injected link delays in the TCPStore, every rank reads
   them (:class:`~impl.common.runtime.link_delay.LinkDelayController`);
2. the scheduler's view of the delays is the injected table ('oracle') or the change
   detector's estimate ('measured'); ``schedule_fn(iteration, delays)`` returns the schedule
   (a compute-only one gets SEND/RECV from :func:`impl.common.schedule.comm.insert_comm`), so
   schedules change only at iteration boundaries; a new schedule is validated before it runs;
3. ranks align their clocks: an all-reduce of the max start timestamp, which becomes every
   rank's iteration origin (message timestamps and the iteration time are relative to it);
4. the rank runs its action list: F/B/W/BW through :class:`~impl.common.runtime.stage.StageRunner`
   (B/W split), SEND/RECV through the comm object; each compute op is padded with a sleep to
   ``op_pad_s`` (BW to twice that) and its raw compute time is recorded separately;
5. comm queues drain, gradients are checked complete, the optimizer steps; an all-reduce of
   the per-link minimum transit times doubles as the end barrier; rank 0 takes the iteration
   time from origin to there.

Errors: a worker that raises reports ``(who, exception)`` to the parent and exits; the parent
terminates every other process and raises one line naming the rank. Process groups carry a
timeout so a hung collective also ends in an error rather than a hang.
"""
from __future__ import annotations

import io
import json
import os
import queue
import statistics
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from faults.spec import LinkDelay
from impl.common.api import ConfigError
from impl.common.models.tiny_gpt import (build_stage, make_microbatches, make_optimizer, params_digest,
                                         validate_shape)
from impl.common.runtime.comm import (Comm, DelegateChannel, DelegatedComm, FifoComm, InlineComm,
                                      MessageSpec, delegate_main, delegate_name, make_delegate_channels)
from impl.common.runtime.link_delay import DelayEstimator, Link, LinkDelayController, all_links
from impl.common.runtime.stage import StageRunner
from impl.common.schedule.ir import Action, Op, Schedule, format_schedule
from impl.common.workloads.pipeline import ModelShape, PipelineWorkload

ScheduleFn = Callable[[int, dict], Schedule]
COMMS = ("inline", "fifo", "delegated")
_COMM_ALIASES = {"in_stream": "fifo"}
_STORE_HOST = "127.0.0.1"
# torch._dynamo: torch.optim imports it lazily on first use, seconds of CPU per process.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "impl.common.runtime.executor"]


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


# ---------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------


@dataclass
class RunStats:
    """What a real pipeline run measured. Times in seconds; iteration lists exclude warm-up
    unless named ``all_``."""

    iteration_times_s: list[float]
    warmup_times_s: list[float]
    losses: list[list[float]]  # every iteration (warm-up first), per micro-batch
    params_digest: str  # sha256 of the final parameters (names + bytes)
    params: dict[str, torch.Tensor]  # final parameters by full-model name (CPU)
    last_grads: dict[str, torch.Tensor]  # accumulated gradients of the last iteration
    raw_compute_s: dict[int, dict[str, float]]  # rank -> op -> total raw compute (measured iters)
    padded_compute_s: dict[int, dict[str, float]]  # rank -> op -> total incl. padding sleep
    op_counts: dict[int, dict[str, int]]  # rank -> op -> count (measured iterations)
    messages: list[dict[str, int]]  # per iteration: "0->1 fwd" -> messages (both ends agreed)
    send_wait_s: dict[int, float]  # rank -> compute-thread time inside send() (measured iters)
    peak_in_flight: dict[int, int]  # rank -> most activations held at once
    detection: str  # 'oracle' or 'measured'
    injected_delays_s: list[dict[str, float]]  # per iteration, "0-1" -> seconds
    scheduler_delays_s: list[dict[str, float]]  # per iteration, what schedule_fn was given
    estimated_delays_s: list[dict[str, float]]  # per iteration end, the detector's estimate
    min_transit_s: list[dict[str, float]]  # per iteration, per link minimum message transit
    comm_paths: list[str]  # per iteration: inline | fifo | delegated
    schedules: list[str]  # distinct schedules run, in order (text form)
    schedule_index: list[int]  # per iteration, index into ``schedules``
    comm: str
    num_delegates: int
    backend: str
    device: str
    start_method: str
    op_pad_s: float
    setup_s: dict[int, float] = field(default_factory=dict)  # rank -> process-group/model setup time
    delegate_messages: dict[str, int] = field(default_factory=dict)  # delegate -> messages handled
    child_pids: list[int] = field(default_factory=list)  # every process started (all gone now)

    def summary(self) -> dict:
        """JSON-able view (no tensors) for records and logs."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("params", "last_grads")}
        out["median_iteration_time_s"] = self.median_iteration_time_s
        out["mean_raw_op_s"] = {op: self.mean_raw_op_s(op) for op in ("F", "B", "W", "BW") if self.mean_raw_op_s(op)}
        return json.loads(json.dumps(out, default=str))

    @property
    def median_iteration_time_s(self) -> float:
        return statistics.median(self.iteration_times_s)

    def mean_raw_op_s(self, op: str) -> float:
        tot = sum(r.get(op, 0.0) for r in self.raw_compute_s.values())
        cnt = sum(c.get(op, 0) for c in self.op_counts.values())
        return tot / cnt if cnt else 0.0


def _link_key(link: Link) -> str:
    return f"{link[0]}-{link[1]}"


def _keyed(table: Mapping[Link, float]) -> dict[str, float]:
    return {_link_key(k): float(v) for k, v in sorted(table.items())}


# ---------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------


@dataclass
class _RunConfig:
    schedule_fn: ScheduleFn
    shape: ModelShape
    num_stages: int
    num_microbatches: int
    micro_batch_size: int
    comm: str
    delegate_when: str
    fifo_depth: int
    controller: LinkDelayController
    iterations: int
    warmup: int
    seed: int
    op_pad_s: float
    backend: str
    optimizer: str
    lr: float
    pg_timeout_s: float
    verify_checksums: bool
    torch_threads: int
    store_port: int
    validate: bool
    # Fault injection: (rank, iteration) at which that rank dies (faults.spec.RankKill).
    kill_at: Optional[tuple[int, int]] = None


def _schedule_has_comm(schedule: Schedule) -> bool:
    return any(not a.op.is_compute for acts in schedule.values() for a in acts)


def prepare_schedule(schedule: Schedule, num_stages: int, num_microbatches: int, *,
                     blocking_sends: bool, validate: bool = True) -> Schedule:
    """Add SEND/RECV to a compute-only schedule and validate it (one-line ScheduleError)."""
    from impl.common.schedule.comm import insert_comm
    from impl.common.schedule.validate import validate_schedule

    if set(schedule) != set(range(num_stages)):
        raise ConfigError(f"schedule: has stages {sorted(schedule)}, the pipeline has 0..{num_stages - 1}")
    full = schedule if _schedule_has_comm(schedule) or num_stages == 1 else insert_comm(schedule)
    if validate:
        validate_schedule(full, num_stages, num_microbatches, blocking_sends=blocking_sends)
    return full


class _Trainer:
    """One rank's state across iterations."""

    def __init__(self, rank: int, cfg: _RunConfig, channels) -> None:
        self.rank = rank
        self.cfg = cfg
        S = cfg.num_stages
        torch.set_num_threads(cfg.torch_threads)
        if cfg.backend == "nccl":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        timeout = timedelta(seconds=cfg.pg_timeout_s)
        self.store = dist.TCPStore(_STORE_HOST, cfg.store_port, is_master=False, timeout=timeout)
        dist.init_process_group(cfg.backend, store=dist.PrefixStore("trainers/", self.store), rank=rank,
                                world_size=S, timeout=timeout)
        stage = build_stage(cfg.shape, rank, S, cfg.seed).to(self.device)
        self.runner = StageRunner(stage, cfg.num_microbatches)
        self.opt = make_optimizer(stage.parameters(), cfg.optimizer, cfg.lr)
        spec = MessageSpec(stage.boundary_shape(cfg.micro_batch_size), torch.float32)
        common = dict(verify_checksums=cfg.verify_checksums, wait_timeout_s=cfg.pg_timeout_s)
        args = (rank, S, cfg.num_microbatches, spec, self.device)
        self.comms: dict[str, Comm] = {}
        need_groups = cfg.comm in ("inline", "fifo") or (cfg.comm == "delegated" and cfg.delegate_when == "on_delay")
        if need_groups:
            # One group per channel (ordered neighbour pair): a channel is driven by one thread
            # per rank, so FIFO workers and the compute thread never share a gloo context.
            # new_group is collective over the world: every rank creates every group in order.
            groups = {}
            for i in range(S - 1):
                for src, dst in ((i, i + 1), (i + 1, i)):
                    g = dist.new_group([i, i + 1], timeout=timeout)
                    if rank in (i, i + 1):
                        groups[(src, dst)] = g
            if cfg.comm == "inline":
                self.comms["inline"] = InlineComm(*args, groups=groups, **common)
            else:
                self.comms["fifo"] = FifoComm(*args, groups=groups, depth=cfg.fifo_depth, **common)
        if cfg.comm == "delegated":
            self.comms["delegated"] = DelegatedComm(*args, channels=channels, **common)
        self.estimator = DelayEstimator(S)
        self.ppid = os.getppid()

    def _pick_comm(self, sched_delays: Mapping[Link, float]) -> Comm:
        if self.cfg.comm != "delegated":
            return self.comms[self.cfg.comm]
        if self.cfg.delegate_when == "always" or any(v > 0 for v in sched_delays.values()):
            return self.comms["delegated"]
        return self.comms["fifo"]

    def _compute(self, op: Op, fn, stats) -> Any:
        t0 = time.perf_counter()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # raw compute time needs the kernels done
        raw = time.perf_counter() - t0
        target = self.cfg.op_pad_s * (2 if op is Op.BW else 1)
        if target > raw:
            time.sleep(target - raw)
        if stats is not None:
            key = op.value
            stats["raw"][key] = stats["raw"].get(key, 0.0) + raw
            stats["padded"][key] = stats["padded"].get(key, 0.0) + time.perf_counter() - t0
            stats["count"][key] = stats["count"].get(key, 0) + 1
        return out

    def _run_actions(self, actions: list[Action], comm: Comm, batches, stats) -> None:
        r = self.runner
        acts: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        outbox: dict[tuple[str, int], torch.Tensor] = {}
        for a in actions:
            j = a.mb
            if a.op is Op.F:
                if r.stage.is_first:
                    inp = batches[j][0]
                elif j in acts:
                    inp = acts.pop(j)
                else:
                    raise RuntimeError(f"rank {self.rank}: F{j} runs before RF{j}<{self.rank - 1} received its input")
                tgt = batches[j][1] if r.stage.is_last else None
                out = self._compute(a.op, lambda: r.forward(j, inp, tgt), stats)
                if out is not None:
                    outbox[("F", j)] = out
            elif a.op in (Op.B, Op.BW):
                if r.stage.is_last:
                    g = None
                elif j in grads:
                    g = grads.pop(j)
                else:
                    raise RuntimeError(f"rank {self.rank}: {a} runs before RB{j}<{self.rank + 1} received its gradient")
                fn = r.backward_input if a.op is Op.B else r.backward_full
                gi = self._compute(a.op, lambda: fn(j, g), stats)
                if gi is not None:
                    outbox[("B", j)] = gi
            elif a.op is Op.W:
                self._compute(a.op, lambda: r.backward_weight(j), stats)
            elif a.op.is_send:
                kind = "F" if a.op is Op.SEND_F else "B"
                if (kind, j) not in outbox:
                    raise RuntimeError(f"rank {self.rank}: {a} before its producer {kind}{j} ran")
                comm.send(outbox.pop((kind, j)), a.peer, j, "fwd" if kind == "F" else "bwd")
            elif a.op is Op.RECV_F:
                acts[j] = comm.recv(a.peer, j, "fwd")
            elif a.op is Op.RECV_B:
                grads[j] = comm.recv(a.peer, j, "bwd")
        if outbox:
            raise RuntimeError(f"rank {self.rank}: results never sent: {sorted(outbox)}")

    def run(self) -> dict:
        cfg, S, N = self.cfg, self.cfg.num_stages, self.cfg.num_microbatches
        total = cfg.warmup + cfg.iterations
        stats = {"raw": {}, "padded": {}, "count": {}}
        out: dict[str, Any] = {k: [] for k in ("times", "losses", "messages", "injected", "sched_delays",
                                               "estimates", "transit", "paths", "schedule_index")}
        schedules: list[str] = []
        validated: set[str] = set()
        send_wait = 0.0
        last_grads: dict[str, torch.Tensor] = {}
        for it in range(total):
            if os.getppid() != self.ppid:
                raise RuntimeError("parent process is gone")
            if cfg.kill_at == (self.rank, it):
                os._exit(17)  # a crash, not an exception: nothing is reported, the parent must notice
            measured = it >= cfg.warmup
            if self.rank == 0:
                cfg.controller.publish(self.store, it)
            injected = cfg.controller.read(self.store, it)
            sched_delays = injected if cfg.controller.detection == "oracle" else dict(self.estimator.estimates)
            comm = self._pick_comm(sched_delays)
            schedule = cfg.schedule_fn(it, dict(sched_delays))
            text = format_schedule(schedule)
            if text not in validated:
                schedule = prepare_schedule(schedule, S, N, blocking_sends=comm.name == "inline",
                                            validate=cfg.validate)
                validated.add(text)
            else:
                schedule = prepare_schedule(schedule, S, N, blocking_sends=False, validate=False)
            if text not in schedules:
                schedules.append(text)
            batches = [(tok.to(self.device), tgt.to(self.device))
                       for tok, tgt in make_microbatches(cfg.shape, cfg.micro_batch_size, N, cfg.seed, it)]

            # Align timelines: everyone starts once the last rank is ready (spec section 8).
            stamp = torch.tensor([time.time()], dtype=torch.float64, device=self.device)
            dist.all_reduce(stamp, op=dist.ReduceOp.MAX)
            # Every rank's origin is that common wall-clock instant, expressed on its local
            # monotonic clock (exact on one host; NTP-accurate across hosts).
            origin_ns = time.perf_counter_ns() - int((time.time() - float(stamp[0])) * 1e9)
            comm.start_iteration(it, injected, origin_ns)
            wait0 = comm.send_wait_s
            self._run_actions(schedule[self.rank], comm, batches, stats if measured else None)
            counts = comm.end_iteration()
            losses = self.runner.finish_iteration()
            if it == total - 1:
                last_grads = {n: p.grad.detach().to("cpu").clone() for n, p in self.runner.stage.named_parameters()}
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            # Per-link min transit over both directions and both ends; also the end barrier.
            mins = comm.monitor.min_transit()
            t = torch.tensor([mins.get(link, float("inf")) for link in all_links(S)] or [0.0],
                             dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            elapsed = (time.perf_counter_ns() - origin_ns) / 1e9
            transit = {link: float(t[i]) for i, link in enumerate(all_links(S))}
            estimates = self.estimator.update(transit)
            if measured:
                send_wait += comm.send_wait_s - wait0
            out["times"].append(elapsed)
            if getattr(self, "progress_q", None) is not None:
                self.progress_q.put(("progress", it, elapsed))
            out["losses"].append(losses)
            out["messages"].append(counts)
            out["injected"].append(_keyed(injected))
            out["sched_delays"].append(_keyed(sched_delays))
            out["estimates"].append(_keyed(estimates))
            out["transit"].append({_link_key(k): v for k, v in transit.items() if v != float("inf")})
            out["paths"].append(comm.name)
            out["schedule_index"].append(schedules.index(text))
        out.update(stats=stats, send_wait=send_wait, peak=self.runner.peak_in_flight, schedules=schedules,
                   params={n: p.detach().to("cpu").clone() for n, p in self.runner.stage.named_parameters()},
                   last_grads=last_grads)
        return out

    def close(self) -> None:
        for c in self.comms.values():
            c.shutdown()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def _trainer_main(rank: int, cfg: _RunConfig, channels, result_q) -> None:
    trainer = None
    try:
        t0 = time.perf_counter()
        trainer = _Trainer(rank, cfg, channels)
        trainer.progress_q = result_q if rank == 0 else None
        setup_s = time.perf_counter() - t0
        result = trainer.run()
        result["setup_s"] = setup_s
        # Tensors through an mp.Queue travel as shared-memory handles that die with this
        # process; plain bytes do not.
        buf = io.BytesIO()
        torch.save(result, buf)
        result_q.put(("result", rank, buf.getvalue()))
    except BaseException as e:  # report and exit; the parent tears the rest down
        result_q.put(("error", f"rank {rank}", type(e).__name__, _one_line(e), traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


# ---------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------


def default_num_delegates(max_delay_s: float) -> int:
    """The artifact's rule (spec section 2.5): K = 3 for delays <= 30 ms, else 6."""
    return 3 if max_delay_s <= 0.030 else 6


def _choose_backend(backend: Optional[str], num_stages: int) -> str:
    if backend is None:
        ok = torch.cuda.is_available() and torch.cuda.device_count() >= num_stages
        return "nccl" if ok else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend: unknown value {backend!r} (one of: gloo, nccl)")
    if backend == "nccl" and not (torch.cuda.is_available() and torch.cuda.device_count() >= num_stages):
        raise ConfigError(f"backend: nccl needs {num_stages} visible GPUs, found "
                          f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    return backend


def _mp_context(start_method: str):
    import torch.multiprocessing as mp

    if start_method not in ("forkserver", "spawn"):
        raise ConfigError(f"start_method: {start_method!r} is not supported (forkserver or spawn)")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # The fork server imports torch once; each worker then starts in milliseconds instead
        # of re-importing torch, with the same clean-process guarantees as spawn.
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


_SECONDARY = ("Connection closed by peer", "Connection reset", "Timed out", "timed out", "parent process is gone",
              "Broken pipe", "SIGTERM")


def _pick_error(errors: list[tuple]) -> tuple:
    """Prefer a root cause over a peer's reaction to it (closed connections, timeouts)."""
    for e in errors:
        if not any(s in e[3] for s in _SECONDARY):
            return e
    return errors[0]


def run_pipeline(schedule_fn: ScheduleFn, shape: Optional[ModelShape] = None,
                 workload: Optional[PipelineWorkload] = None, comm: str = "inline",
                 delays: Union[None, LinkDelay, Mapping[Link, float]] = None,
                 iterations: Optional[int] = None, warmup: Optional[int] = None, seed: int = 0,
                 num_delegates: Optional[int] = None, op_pad_s: float = 0.0, backend: Optional[str] = None, *,
                 optimizer: str = "sgd", lr: float = 0.1, detection: Optional[str] = None,
                 fifo_depth: int = 1, delegate_when: str = "always", pg_timeout_s: float = 120.0,
                 timeout_s: float = 900.0, start_method: str = "forkserver", verify_checksums: bool = True,
                 validate: bool = True, progress: bool = False,
                 kill_at: Optional[tuple[int, int]] = None) -> RunStats:
    """Run ``warmup + iterations`` training iterations of the tiny GPT on S processes.

    ``schedule_fn(iteration, {(i, i+1): seconds}) -> Schedule`` is called by every rank at
    every iteration start with the delays the scheduler may know (see ``detection``);
    compute-only schedules get SEND/RECV inserted. ``comm``: 'inline' | 'fifo' (alias
    'in_stream') | 'delegated'. ``delays``: a LinkDelay fault or a fixed ``{link: seconds}``
    table. ``delegate_when='on_delay'`` uses the FIFO path until the scheduler sees a delay.
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
    controller = LinkDelayController(delays, S, detection)
    K = 0
    if comm == "delegated":
        K = num_delegates or default_num_delegates(controller.max_delay_s(warmup + iterations))
        if K < 1:
            raise ConfigError(f"num_delegates: must be >= 1, got {K}")
        if N % K:
            raise ConfigError(f"workload.num_microbatches {N} is not divisible by delegate count {K} (num_delegates)")
    backend = _choose_backend(backend, S)
    # Validate the first schedule here, before any process starts: bad input fails in one line.
    first_delays = controller.delays_at(0) if controller.detection == "oracle" else dict.fromkeys(all_links(S), 0.0)
    prepare_schedule(schedule_fn(0, dict(first_delays)), S, N,
                     blocking_sends=comm == "inline", validate=validate)

    ctx = _mp_context(start_method)
    store = dist.TCPStore(_STORE_HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=pg_timeout_s))
    cfg = _RunConfig(schedule_fn, shape, S, N, workload.micro_batch_size, comm, delegate_when, fifo_depth,
                     controller, iterations, warmup, seed, op_pad_s, backend, optimizer, lr, pg_timeout_s,
                     verify_checksums, max(1, workload.torch_threads), store.port, validate,
                     None if kill_at is None else (int(kill_at[0]), int(kill_at[1])))
    result_q = ctx.Queue()
    procs: dict[str, Any] = {}
    channels: dict[tuple[int, int], DelegateChannel] = {}
    results: dict[int, dict] = {}
    delegate_counts: dict[str, int] = {}
    errors: list[tuple] = []
    deadline = time.monotonic() + timeout_s

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=warmup + iterations, desc=f"real pipeline S={S} N={N} ({comm})", unit="it", leave=False)

    def handle(msg) -> None:
        kind = msg[0]
        if kind == "result":
            results[msg[1]] = torch.load(io.BytesIO(msg[2]), weights_only=True)
        elif kind == "error":
            errors.append(msg)
        elif kind == "progress":
            if bar is not None:
                bar.set_postfix_str(f"iteration {msg[1]}: {msg[2]:.3f} s", refresh=False)
                bar.update(1)
        elif kind == "delegate_done":
            delegate_counts[msg[1]] = msg[2]

    def drain(block_s: float) -> list:
        got = []
        try:
            got.append(result_q.get(timeout=block_s))
            while True:
                got.append(result_q.get_nowait())
        except queue.Empty:
            pass
        return got

    def dead_unreported() -> Optional[tuple]:
        reported = {e[1] for e in errors}
        # The injected victim first: its silence is the cause of everything else.
        order = sorted(procs.items(), key=lambda kv: kv[0] != (f"rank {kill_at[0]}" if kill_at else None))
        for name, p in order:
            if p.exitcode not in (None, 0):
                rank = int(name.split()[1]) if name.startswith("rank ") else None
                if (rank is not None and rank in results) or name in reported:
                    continue
                if kill_at is not None and rank == kill_at[0]:
                    return ("error", name, "InjectedFault", f"killed by the rank_kill fault at iteration {kill_at[1]} "
                            f"(exit code {p.exitcode})")
                return ("error", name, "ProcessDied", f"exited with code {p.exitcode} without reporting an error "
                        "(at start-up? the caller's __main__ must be import-safe: if __name__ == '__main__')")
        return None

    try:
        if comm == "delegated":
            spec = MessageSpec((workload.micro_batch_size, shape.seq_len, shape.hidden), torch.float32)
            channels = make_delegate_channels(ctx, S, K, N, spec)
            for ch in channels.values():
                for role in ("send", "recv"):
                    for k in range(K):
                        name = delegate_name(role, ch, k)
                        p = ctx.Process(target=delegate_main, name=name, daemon=True,
                                        args=(role, ch, k, _STORE_HOST, store.port, pg_timeout_s, result_q))
                        p.start()
                        procs[name] = p
            ready = 0
            while ready < len(procs) and not errors:  # all pairs connected before training starts
                for msg in drain(0.2):
                    if msg[0] == "ready":
                        ready += 1
                    else:
                        handle(msg)
                died = dead_unreported()
                if died:
                    errors.extend(m for m in drain(0.5) if m[0] == "error")
                    errors.append(died)
                if time.monotonic() > deadline:
                    errors.append(("error", "delegates", "TimeoutError", f"only {ready}/{len(procs)} started in time"))
        if not errors:
            for rank in range(S):
                p = ctx.Process(target=_trainer_main, name=f"rank {rank}", args=(rank, cfg, channels, result_q))
                p.start()
                procs[f"rank {rank}"] = p
        while not errors and len(results) < S:
            for msg in drain(0.2):
                handle(msg)
            if errors:
                break
            died = dead_unreported()
            if died:
                for msg in drain(1.0):  # its own report may still be in the pipe
                    handle(msg)
                if not errors:
                    errors.append(died)
            if time.monotonic() > deadline:
                errors.append(("error", "executor", "TimeoutError",
                               f"run exceeded timeout_s={timeout_s:.0f} (ranks done: {sorted(results)})"))
        if errors:
            for msg in drain(1.0):  # give the root cause a moment to arrive
                handle(msg)
            # A rank that died silently is the root cause of its peers' connection errors.
            time.sleep(0.2)
            died = dead_unreported()
            if died and died[2] == "InjectedFault":
                errors.insert(0, died)
    finally:
        # After a failure the survivors are typically blocked on a dead peer: don't wait long.
        _shutdown(procs, channels, drain, handle, grace_s=1.0 if errors else 10.0)
        del store
        if bar is not None:
            bar.close()

    if errors:
        _, who, etype, text = _pick_error(errors)[:4]
        line = f"pipeline {who} failed: {etype}: {text}"
        if etype in ("ConfigError", "ScheduleError"):
            raise ConfigError(line)
        raise RuntimeError(line)
    return _collect(results, cfg, K, delegate_counts, [p.pid for p in procs.values()], start_method)


def _shutdown(procs: dict, channels: dict, drain, handle, grace_s: float) -> None:
    """Stop delegates, join everything (reading the queue meanwhile), then terminate/kill."""
    for ch in channels.values():
        ch.request_stop()
    end = time.monotonic() + grace_s
    while any(p.is_alive() for p in procs.values()) and time.monotonic() < end:
        for msg in drain(0.05):
            handle(msg)
    for sig in ("terminate", "kill"):
        alive = [p for p in procs.values() if p.is_alive()]
        for p in alive:
            getattr(p, sig)()
        for p in alive:
            p.join(timeout=3.0)
    for p in procs.values():
        p.join(timeout=0.1)


def _collect(results: dict[int, dict], cfg: _RunConfig, K: int, delegate_counts: dict, pids: list,
             start_method: str) -> RunStats:
    S, warm = cfg.num_stages, cfg.warmup
    r0 = results[0]
    last = results[S - 1]
    params: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for r in range(S):
        params.update(results[r]["params"])
        grads.update(results[r]["last_grads"])
    messages = []
    for it in range(warm + cfg.iterations):
        merged: dict[str, int] = {}
        for r in range(S):
            for k, v in results[r]["messages"][it].items():
                if merged.setdefault(k, v) != v:
                    raise RuntimeError(f"iteration {it}: {k} counted {merged[k]} by one end and {v} by the other")
        messages.append(merged)
    paths = r0["paths"]
    return RunStats(
        iteration_times_s=r0["times"][warm:], warmup_times_s=r0["times"][:warm], losses=last["losses"],
        params_digest=params_digest(params), params=params, last_grads=grads,
        raw_compute_s={r: results[r]["stats"]["raw"] for r in range(S)},
        padded_compute_s={r: results[r]["stats"]["padded"] for r in range(S)},
        op_counts={r: results[r]["stats"]["count"] for r in range(S)},
        messages=messages, send_wait_s={r: results[r]["send_wait"] for r in range(S)},
        peak_in_flight={r: results[r]["peak"] for r in range(S)}, detection=cfg.controller.detection,
        injected_delays_s=r0["injected"], scheduler_delays_s=r0["sched_delays"],
        estimated_delays_s=r0["estimates"], min_transit_s=r0["transit"], comm_paths=paths,
        schedules=r0["schedules"], schedule_index=r0["schedule_index"], comm=cfg.comm, num_delegates=K,
        backend=cfg.backend, device="cuda" if cfg.backend == "nccl" else "cpu", start_method=start_method,
        op_pad_s=cfg.op_pad_s, setup_s={r: results[r]["setup_s"] for r in range(S)},
        delegate_messages=dict(delegate_counts), child_pids=pids)
