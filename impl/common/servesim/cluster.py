"""Request-level discrete-event simulation of one or many multi-LoRA servers.

Each server runs the same :class:`~impl.common.llm.scheduler.BatchScheduler` as the real
engine (continuous batching, prefill first, adapter pool with LRU + pinning); iteration times
come from :class:`~impl.common.servesim.cost.ServingCost`. A router (``route(req, servers,
now) -> index``) places each arrival. Deterministic: plain floats, insertion-ordered events,
seeded RNGs only; the same inputs give bit-identical results.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from impl.common.llm.lora import group_of_layer
from impl.common.llm.metrics import RequestRecord
from impl.common.llm.scheduler import BatchScheduler, Plan, SchedulerConfig, SReq
from impl.common.servesim.cost import ServingCost
from impl.common.sim.engine import Engine


@dataclass
class SimResult:
    records: list
    arrived: int
    dropped: int
    makespan_s: float
    stall_s: float
    busy_s: float
    cpu_layers: int = 0
    loads: int = 0
    per_server_busy_s: list = field(default_factory=list)


class SimServer:
    def __init__(self, sid: int, cfg: SchedulerConfig, cost: ServingCost, engine: Engine, on_done: Callable,
                 slo_of: Callable[[SReq], float], cpu_assist: bool = True):
        self.sid = sid
        self.cfg = cfg
        self.sched = BatchScheduler(cfg)
        self.cost = cost
        self.eng = engine
        self.on_done = on_done
        self.slo_of = slo_of
        self.busy = False
        self.link_free_s = 0.0
        self.ready_at: dict[str, list] = {}  # adapter -> per-group ready times
        self.groups = cfg.load_groups
        self.group_of = group_of_layer(cost.num_layers, cfg.load_groups)
        self.stall_s = 0.0
        self.busy_s = 0.0
        self.cpu_layers = 0
        self.loads = 0
        self.wake_at: Optional[float] = None
        self.merged: Optional[str] = None
        self.version = 0  # bumped on every change of queue/batch state (routers cache on it)

    # ---- state visible to routers ---------------------------------------------------------
    def active(self) -> int:
        return len(self.sched.running) + len(self.sched.waiting)

    def batch(self) -> list:
        return list(self.sched.running)

    def queue(self) -> list:
        return list(self.sched.waiting)

    # ---- loads ----------------------------------------------------------------------------
    def _start_load(self, adapter: str, rank: int, now: float) -> float:
        """FIFO over the host link; returns when the last group is resident."""
        start = max(now, self.link_free_s)
        T = self.cost.load_s(rank)
        times, t = [], start
        for g in range(self.groups):
            t = start + T * (g + 1) / self.groups
            times.append(t)
        self.ready_at[adapter] = times
        self.link_free_s = times[-1]
        self.loads += 1
        return times[-1]

    def _resident(self, adapter: str, now: float) -> bool:
        entry = self.sched.pool.get(adapter)
        if entry is None:
            return False
        if entry.resident():
            return True
        times = self.ready_at.get(adapter)
        if times is None:
            return False
        for g, t in enumerate(times):
            if t <= now:
                entry.ready[g] = True
        return entry.resident()

    def _ranks(self, adapter: str) -> int:
        return self.rank_of[adapter]

    # ---- events ---------------------------------------------------------------------------
    def arrive(self, r: SReq, now: float) -> None:
        self.version += 1
        a = self.sched.arrive(r)
        if a is not None:
            self._start_load(a, r.rank, now)
        self._kick(now)

    def _kick(self, now: float) -> None:
        if self.busy:
            return
        self.version += 1
        for a in self.sched.retry_pins():
            self._start_load(a, self._rank_in_queue(a), now)
        plan = self.sched.plan(lambda r: self._resident(r.adapter, now))
        if plan is None:
            # waiting only on loads (CaraServe decode needs full residency): wake at the next one
            pending = [t[-1] for a, t in self.ready_at.items() if t[-1] > now and a in self.sched.pool]
            if pending and self.sched.busy():
                w = min(pending)
                if self.wake_at is None or w < self.wake_at or self.wake_at <= now:
                    self.wake_at = w
                    self.eng.schedule(w, self._wake)
            return
        self.busy = True
        dur, stall = self._duration(plan, now)
        for a in plan.prefetch:  # S-LoRA: async loads for the next batch, behind this iteration
            self.ready_at.pop(a, None)
            self._start_load(a, self._rank_in_queue(a), now + stall)
        self.stall_s += stall
        self.busy_s += dur
        self.eng.schedule(now + dur, self._finish, plan)

    def _rank_in_queue(self, adapter: str) -> int:
        for r in list(self.sched.waiting) + self.sched.running:
            if r.adapter == adapter:
                return r.rank
        return 64

    def _wake(self, _=None) -> None:
        self.wake_at = None
        self._kick(self.eng.now_s)

    def _duration(self, plan: Plan, now: float) -> tuple[float, float]:
        c, pol = self.cost, self.cfg.policy
        reqs = plan.reqs
        stall = 0.0
        if plan.merged != self.merged:
            if plan.merged is not None:  # dLoRA merge: W += sBA per site and layer (a GEMM each)
                stall += c.weight_bytes * 4 / 7 / c.mem_bw_bytes_per_s * 2
            self.merged = plan.merged
        lora = plan.merged is None
        if plan.kind == "decode":
            ctx = [r.prompt_len + r.generated for r in reqs]
            return stall + c.decode_s(ctx, [r.rank for r in reqs], self.sched.decode_kernel, lora=lora), stall
        lens, ranks = [r.prompt_len for r in reqs], [r.rank for r in reqs]
        for a in plan.new_adapters:  # a slot re-acquired after eviction: its old load is void
            self.ready_at.pop(a, None)
        for r in reqs:
            r.data["cold"] = not self._resident(r.adapter, now)
        if pol in ("ondmd", "punica", "dlora", "slora"):
            for a in plan.new_adapters:
                rank = next(r.rank for r in reqs if r.adapter == a)
                self._start_load(a, rank, now)
        start = now
        if pol in ("ondmd", "punica", "dlora", "slora"):
            for r in reqs:
                if r.adapter in self.ready_at:
                    start = max(start, self.ready_at[r.adapter][-1])
        elif pol == "caraserve":
            for a in plan.new_adapters:
                rank = next(r.rank for r in reqs if r.adapter == a)
                self._start_load(a, rank, now)
        stall += start - now
        total = c.prefill_s(lens, ranks, lora=lora, kernel=self.sched.prefill_kernel)
        if pol != "caraserve":
            return stall + total, stall
        cold = [r for r in reqs if not self._resident(r.adapter, now)]
        if not cold:
            return total, stall
        # CaraServe (spec 2.1): layer by layer; a cold request's layer runs on the CPU path unless
        # the layer's group is resident when the layer starts (switch at a layer boundary); the
        # layer waits for the slowest delta. All cold requests on the CPU path in a layer share the
        # host's cores and link (cost.cpu_layer_s).
        base = c.prefill_s(lens, ranks, lora=True) / c.num_layers
        t = now
        memo: dict = {}
        for l in range(c.num_layers):
            g = self.group_of[l]
            jobs = []
            for r in cold:
                if self.ready_at[r.adapter][g] > t:
                    jobs.append((r.prompt_len, r.rank))
                    self.cpu_layers += 1
            jobs = tuple(jobs)
            if jobs not in memo:
                memo[jobs] = c.cpu_layer_s(jobs)
            t += max(base, memo[jobs])
        return t - now, stall

    def _finish(self, plan: Plan) -> None:
        now = self.eng.now_s
        self.busy = False
        self.version += 1
        if plan.kind == "prefill":
            for r in plan.reqs:
                r.data["first_s"] = now
            done = self.sched.prefilled(plan)
        else:
            done = self.sched.decoded(plan)
        for r in done:
            self.on_done(self, r, now)
        self._kick(now)


def simulate(requests: Sequence[SReq], num_servers: int, cfg: SchedulerConfig, cost: ServingCost,
             route: Callable, slo_of: Callable[[SReq], float], preload: Sequence[str] = (),
             progress=None, isolated_of: Optional[Callable[[SReq], float]] = None) -> SimResult:
    eng = Engine()
    records: list = []

    def done(server, r, now):
        records.append(RequestRecord(rid=r.rid, adapter=r.adapter, rank=r.rank, arrival_s=r.arrival_s,
                                     first_token_s=r.data["first_s"], done_s=now, output_len=r.output_len,
                                     cold=r.data.get("cold", False), interruptions=r.interruptions,
                                     slo_tpot_s=slo_of(r), server=server.sid,
                                     isolated_s=isolated_of(r) if isolated_of else 0.0))
        if progress is not None:
            progress.update(1)

    servers = [SimServer(i, cfg, cost, eng, done, slo_of) for i in range(num_servers)]
    for s in servers:
        for a in preload:
            s.sched.pool.preload(a)

    def arrive(r: SReq):
        now = eng.now_s
        i = route(r, servers, now)
        servers[i].arrive(r, now)

    for r in requests:
        eng.schedule(r.arrival_s, arrive, r)
    eng.run()
    makespan = max((r.done_s for r in records), default=0.0) - min((r.arrival_s for r in requests), default=0.0)
    return SimResult(records=sorted(records, key=lambda x: x.rid), arrived=len(requests),
                     dropped=len(requests) - len(records), makespan_s=makespan,
                     stall_s=sum(s.stall_s for s in servers), busy_s=sum(s.busy_s for s in servers),
                     cpu_layers=sum(s.cpu_layers for s in servers), loads=sum(s.loads for s in servers),
                     per_server_busy_s=[s.busy_s for s in servers])
