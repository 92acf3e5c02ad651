"""One pipeline rank (the worker side of :func:`impl.common.runtime.executor.run_pipeline`).

Each iteration, on every rank: rank 0 publishes the iteration's injected link delays in the
launch's store and every rank reads them; ``schedule_fn(iteration, delays)`` gives the
schedule (validated the first time it is seen); ranks align their clocks with an all-reduce
of the max start timestamp; the rank runs its actions (compute padded to ``op_pad_s``,
SEND/RECV through the comm object); queues drain, gradients are checked, the optimizer steps;
an all-reduce of per-link minimum transit times doubles as the end barrier.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from impl.common.api import ConfigError
from impl.common.models.tiny_gpt import build_stage, make_microbatches, make_optimizer
from impl.common.runtime.comm import Comm, FifoComm, InlineComm, MessageSpec
from impl.common.runtime.launch import RankContext
from impl.common.runtime.link_delay import DelayEstimator, Link, LinkDelayController, all_links
from impl.common.runtime.run_stats import keyed, link_key
from impl.common.runtime.stage import StageRunner
from impl.common.schedule.ir import Action, Op, Schedule, format_schedule
from impl.common.workloads.pipeline import ModelShape
from impl.common.execution import set_torch_threads

ScheduleFn = Callable[[int, dict], Schedule]


@dataclass
class TrainerConfig:
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
    optimizer: str
    lr: float
    pg_timeout_s: float
    verify_checksums: bool
    torch_threads: int
    validate: bool
    num_delegates: int = 0
    # Fault injection: (rank, iteration) at which that rank dies (impl.common.fault_model.spec.RankKill).
    kill_at: Optional[tuple[int, int]] = None
    # A static slow GPU (fault_model.spec.ComputeSlowdown): per-rank factor on the padded op time.
    slowdown: Optional[tuple[float, ...]] = None


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

    def __init__(self, ctx: RankContext, cfg: TrainerConfig, channels) -> None:
        rank = ctx.rank
        self.rank = rank
        self.cfg = cfg
        S = cfg.num_stages
        set_torch_threads(cfg.torch_threads)
        self.device = ctx.device
        self.store = ctx.store
        self.own_delegates = None
        if cfg.comm == "delegated" and channels is None:
            # torchrun: this rank starts its own side's delegates, on its own host.
            from impl.common.runtime.delegated import LocalDelegates

            spec0 = MessageSpec((cfg.micro_batch_size, cfg.shape.seq_len, cfg.shape.hidden), torch.float32)
            self.own_delegates = LocalDelegates(rank, S, cfg.num_delegates, cfg.num_microbatches, spec0,
                                                ctx.store_address, cfg.pg_timeout_s)
            channels = self.own_delegates.channels
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
                    g = dist.new_group([i, i + 1])
                    if rank in (i, i + 1):
                        groups[(src, dst)] = g
            if cfg.comm == "inline":
                self.comms["inline"] = InlineComm(*args, groups=groups, **common)
            else:
                self.comms["fifo"] = FifoComm(*args, groups=groups, depth=cfg.fifo_depth, **common)
        if cfg.comm == "delegated":
            from impl.common.runtime.delegated import DelegatedComm

            health = self.own_delegates.check if self.own_delegates is not None else None
            self.comms["delegated"] = DelegatedComm(*args, channels=channels, health=health, **common)
        self.estimator = DelayEstimator(S)
        self.ppid = os.getppid()
        self.report = ctx.report if rank == 0 else None

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
        target = self.cfg.op_pad_s * (2 if op is Op.BW else 1) * (self.cfg.slowdown[self.rank] if self.cfg.slowdown else 1.0)
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

            # Align timelines: everyone starts once the last rank is ready.
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
            if self.report is not None:
                self.report((it, elapsed))
            out["losses"].append(losses)
            out["messages"].append(counts)
            out["injected"].append(keyed(injected))
            out["sched_delays"].append(keyed(sched_delays))
            out["estimates"].append(keyed(estimates))
            out["transit"].append({link_key(k): v for k, v in transit.items() if v != float("inf")})
            out["paths"].append(comm.name)
            out["schedule_index"].append(schedules.index(text))
        out.update(stats=stats, send_wait=send_wait, peak=self.runner.peak_in_flight, schedules=schedules,
                   params={n: p.detach().to("cpu").clone() for n, p in self.runner.stage.named_parameters()},
                   last_grads=last_grads)
        return out

    def close(self) -> dict[str, int]:
        """Shut the comm paths down; return messages handled per own delegate (torchrun)."""
        for c in self.comms.values():
            c.shutdown()
        return self.own_delegates.stop() if self.own_delegates is not None else {}


def trainer_main(ctx: RankContext, cfg: TrainerConfig, channels) -> dict:
    """The launcher's worker: build this rank, train, return its report (tensors on CPU).
    ``channels``: the parent's delegate channels (local job), or None (own delegates)."""
    t0 = time.perf_counter()
    trainer = None
    try:
        trainer = _Trainer(ctx, cfg, channels)
        setup_s = time.perf_counter() - t0
        result = trainer.run()
        result["setup_s"] = setup_s
    finally:
        counts = trainer.close() if trainer is not None else {}
    result["delegate_messages"] = counts
    result["delegate_pids"] = trainer.own_delegates.pids if trainer.own_delegates is not None else []
    return result
