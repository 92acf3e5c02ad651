"""Request-level discrete-event simulation of one or many multi-LoRA servers.

Each server runs the same :class:`~impl.common.llm.scheduler.BatchScheduler` as the real
engine (continuous batching, prefill first, adapter pool with LRU + pinning); iteration times
come from :class:`~impl.common.servesim.cost.ServingCost`. A router (``route(req, servers,
now) -> index``) places each arrival. Deterministic: plain floats, insertion-ordered events,
seeded RNGs only; the same inputs give bit-identical results.

dLoRA's request-adapter co-migration (a policy that ``migrates``, more than one server,
``SchedulerConfig.dlora_migrate``) is a periodic balancer in the same event engine
(:class:`Migrator`); every other policy schedules no extra event.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from impl.common.llm.lora import group_of_layer
from impl.common.llm.metrics import RequestRecord
from impl.common.llm.scheduler import BatchScheduler, IterationPlan, SchedulerConfig, SReq
from impl.common.servesim.cost import ServingCost
from impl.common.sim.events import EventLoop


@dataclass
class ServingSimResult:
    records: list
    arrived: int
    dropped: int
    makespan_s: float
    stall_s: float
    busy_s: float
    cpu_layers: int = 0
    underpriced: int = 0  # iterations priced below the same batch fully resident (must be 0)
    lora_rows: int = 0  # request rows of iterations that ran a LoRA delta (GPU or CPU path)
    loads: int = 0
    per_server_busy_s: list = field(default_factory=list)
    migrations: Optional[dict] = None  # dlora only: counts (see Migrator.summary)
    migration_log: list = field(default_factory=list)  # dlora only: one MigrationEvent per request moved
    kernel_law: Optional[object] = None  # set by the caller that fitted a router's kernel law
    # Mean iteration time by kind over all servers, loads and CPU path included (v1 Fig. 11's
    # per-iteration figures): {"prefill": s, "decode": s}; None for a kind that never ran.
    iteration_mean_s: dict = field(default_factory=dict)


@dataclass(frozen=True)
class MigrationEvent:
    rid: int
    adapter: str
    kind: str  # waiting | running
    src: int
    dst: int
    depart_s: float
    arrive_s: float  # running: depart + KV transfer; waiting: depart (prompt only, no KV yet)
    kv_bytes: float
    generated: int  # tokens already produced when it left


class SimServer:
    def __init__(self, sid: int, cfg: SchedulerConfig, cost: ServingCost, engine: EventLoop, on_done: Callable,
                 slo_of: Callable[[SReq], float], cpu_assist: bool = True, lora: bool = True):
        self.sid = sid
        self.cfg = cfg
        self.lora = lora  # False: the base model only (the SLO reference run): no LoRA compute, no loads
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
        self.iter_s = {"prefill": [0.0, 0], "decode": [0.0, 0]}  # kind -> [total s, count] (v1 Fig. 11)
        self.cpu_layers = 0
        # iterations priced below the same batch with every adapter resident (the order check of
        # impl/caraserve/README.md, per iteration; the simulator's own check, 0 unless a cost term is wrong)
        self.underpriced = 0
        self.lora_rows = 0  # request rows of iterations computed with a LoRA delta (base-only run: 0)
        self.loads = 0
        self.wake_at: Optional[float] = None
        self.merged: Optional[str] = None
        self.version = 0  # bumped on every change of queue/batch state (routers cache on it)
        self.migrator: Optional["Migrator"] = None
        self.incoming = 0  # running requests whose KV cache is on its way here
        self.load_copies = 2.0 if cfg.policy.loads_ab_twice and cost.slora_copies_ab_twice else 1.0
        self.outbox: list = []  # running requests leaving at the end of the iteration in flight

    # ---- state visible to routers ---------------------------------------------------------
    def active(self) -> int:
        return len(self.sched.running) + len(self.sched.waiting)

    def batch(self) -> list:
        return list(self.sched.running)

    def queue(self) -> list:
        return list(self.sched.waiting)

    def load(self) -> int:
        """Balancer's view: requests this server will serve (in-flight handoffs already counted
        at their destination, so two ticks never move the same work twice)."""
        return len(self.sched.running) + len(self.sched.waiting) + self.incoming - len(self.outbox)

    # ---- loads ----------------------------------------------------------------------------
    def _start_load(self, adapter: str, rank: int, now: float) -> float:
        """FIFO over the host link; returns when the last group is resident."""
        start = max(now, self.link_free_s)
        T = self.cost.load_s(rank, self.load_copies)
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
        if self.cfg.policy.decode_waits_for_load:
            plan = self.sched.plan(lambda r: True)  # the step waits for the loads (_duration)
        else:
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
        if stall > 0:
            # Stall accounting as the paper counts it (v1 Fig. 3-left): every request in the iteration
            # sits through the load (its own), and so does every in-flight decode it pauses.
            sitting = plan.reqs if plan.kind == "decode" else list(plan.reqs) + list(self.sched.running)
            for r in sitting:
                r.data["stall_s"] = r.data.get("stall_s", 0.0) + stall
                r.data["load_stalls"] = r.data.get("load_stalls", 0) + 1
        for a in plan.prefetch:  # S-LoRA: async loads for the next batch, behind this iteration
            self.ready_at.pop(a, None)
            self._start_load(a, self._rank_in_queue(a), now + stall)
        self.stall_s += stall
        self.busy_s += dur
        self.iter_s[plan.kind][0] += dur
        self.iter_s[plan.kind][1] += 1
        self.eng.schedule(now + dur, self._finish, plan)

    def _rank_in_queue(self, adapter: str) -> int:
        for r in list(self.sched.waiting) + self.sched.running:
            if r.adapter == adapter:
                return r.rank
        return 64

    def _wake(self, _=None) -> None:
        self.wake_at = None
        self._kick(self.eng.now_s)

    def _duration(self, plan: IterationPlan, now: float) -> tuple[float, float]:
        c, pol = self.cost, self.cfg.policy
        reqs = plan.reqs
        stall = 0.0
        if plan.merged != self.merged:
            if plan.merged is not None:  # dLoRA merge: W += sBA per site and layer (a GEMM each)
                stall += c.weight_bytes * 4 / 7 / c.mem_bw_bytes_per_s * 2
            self.merged = plan.merged
        lora = plan.merged is None and self.lora
        if lora:
            self.lora_rows += sum(1 for r in reqs if r.rank > 0)
        if plan.kind == "decode":
            ctx = [r.prompt_len + r.generated for r in reqs]
            step = c.decode_s(ctx, [r.rank for r in reqs], self.sched.decode_kernel, lora=lora)
            loading = sorted({r.adapter for r in reqs if not self._resident(r.adapter, now)})
            if not loading:
                return stall + step, stall
            # decode_waits_for_load (CaraServe): a request whose prefill ended before its adapter
            # finished loading decodes with the batch, and each layer waits for its group of
            # every such adapter (the GPU stream waits on the load's event per group); decode
            # never runs on the CPU (as in the paper). The wait is a load stall for the whole batch.
            per, t = step / c.num_layers, now
            for l in range(c.num_layers):
                g = self.group_of[l]
                t = max([t] + [self.ready_at[a][g] for a in loading]) + per
            wait = (t - now) - step
            return stall + wait + step, stall + wait
        lens, ranks = [r.prompt_len for r in reqs], [r.rank for r in reqs]
        for a in plan.new_adapters:  # a slot re-acquired after eviction: its old load is void
            self.ready_at.pop(a, None)
        for r in reqs:
            r.data["cold"] = not self._resident(r.adapter, now)
        if pol.sync_load:
            for a in plan.new_adapters:
                rank = next(r.rank for r in reqs if r.adapter == a)
                self._start_load(a, rank, now)
        start = now
        if pol.sync_load:
            for r in reqs:
                if r.adapter in self.ready_at:
                    start = max(start, self.ready_at[r.adapter][-1])
        elif pol.async_load:
            for a in plan.new_adapters:
                rank = next(r.rank for r in reqs if r.adapter == a)
                self._start_load(a, rank, now)
        stall += start - now
        total = c.prefill_s(lens, ranks, lora=lora, kernel=self.sched.prefill_kernel)
        if not pol.cpu_assisted_prefill:
            return stall + total, stall
        cold = [r for r in reqs if not self._resident(r.adapter, now)]
        if not cold:
            return total, stall
        # CaraServe's request path (the paper): layer by layer; a cold request's layer runs on the
        # CPU path unless the layer's group is resident when the layer starts (switch at a layer
        # boundary). Each LoRA input's CPU path overlaps its own base GEMM only, and all cold
        # requests on the CPU path in a layer share the host's cores and link
        # (cost.cpu_layer_extra_s, which also adds the serial hand-off cost.cpu_layer_overhead_s per
        # cold request, 0 by default).
        base = total / c.num_layers  # the device layer with every adapter resident, this policy's kernel
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
                memo[jobs] = c.cpu_layer_extra_s(jobs, base)
            t += base + memo[jobs]
        if t - now < total * (1 - 1e-9):
            self.underpriced += 1  # never below the same batch with every adapter resident
        return t - now, stall

    def _finish(self, plan: IterationPlan) -> None:
        now = self.eng.now_s
        self.busy = False
        self.version += 1
        if plan.kind == "prefill":
            for r in plan.reqs:
                r.data["first_s"] = now
            done = self.sched.prefilled(plan)
        else:
            done = self.sched.decoded(plan)
        for a in self.sched.evicted:  # evict_on_finish: a later load of it starts afresh
            self.ready_at.pop(a, None)
        self.sched.evicted.clear()
        for r in done:
            self.on_done(self, r, now)
        if self.outbox:
            self.migrator.ship(self, now)
        self._kick(now)

    # ---- migration (dLoRA) ----------------------------------------------------------------
    def take_waiting(self, reqs: list) -> None:
        ids = {id(r) for r in reqs}
        sched = self.sched
        for r in reqs:
            if r.pinned:
                sched.pool.release(r.adapter)
                r.pinned = False
            else:
                sched.unpinned -= 1
        sched.waiting = deque(r for r in sched.waiting if id(r) not in ids)
        self.version += 1

    def receive_waiting(self, reqs: list, now: float) -> None:
        """Moved queued requests keep their arrival order (FIFO by arrival, ties by id) rather
        than queueing behind later local arrivals."""
        sched = self.sched
        sched.waiting = deque(sorted(list(sched.waiting) + list(reqs), key=lambda r: (r.arrival_s, r.rid)))
        sched.unpinned += len(reqs)
        self.version += 1
        self._kick(now)

    def land(self, r: SReq) -> None:
        self.incoming -= 1
        self.sched.running.append(r)
        self.version += 1
        self._kick(self.eng.now_s)


class Migrator:
    """dLoRA co-migration [R] (dLoRA, OSDI'24, migrates requests and adapters across replicas; its
    own planner is not public in enough detail, so this is a greedy stand-in: impl/caraserve/README.md).

    Every ``interval_s`` of sim time: while the most loaded server (``SimServer.load``) exceeds
    the least loaded by more than ``threshold`` requests, move up to half the gap from the former
    to the latter (ties: lowest id). Requests move per adapter: the largest groups that fit the
    budget go whole (queued and running together, so the adapter leaves with its requests and the
    source frees its slot), largest first, then fewest running (KV to move), then adapter name; if
    no group fits, the queue tail of the largest group with a queue moves (the adapter is then on
    both servers). The source's merged-mode adapter stays (merged mode serves it fastest there).
    - Queued requests move at once: no KV exists yet and a prompt is a few KiB; the destination
      loads the adapter through its own pool and loader at prefill, like any arrival.
    - Running requests leave at the source's next iteration boundary (never mid-iteration), are
      pinned in the destination's pool (a load starts if new), and join its batch after the KV
      transfer, ``intra_latency_s + kv_bytes_per_token x context / intra_bw_bytes_per_s``, during
      which they make no progress. Only as many as the destination's batch has room for.
    """

    def __init__(self, servers: list, cost: ServingCost, eng: EventLoop, interval_s: float, threshold: int):
        self.servers, self.cost, self.eng = servers, cost, eng
        self.interval_s, self.threshold = interval_s, threshold
        self.ticks = 0
        self.log: list = []
        self.adapters = 0
        self._groups_seen: set = set()
        for s in servers:
            s.migrator = self

    @staticmethod
    def empty() -> dict:
        return {"requests": 0, "waiting": 0, "running": 0, "adapters": 0, "kv_bytes": 0.0, "ticks": 0}

    def summary(self) -> dict:
        waiting = sum(1 for e in self.log if e.kind == "waiting")
        return {"requests": len(self.log), "waiting": waiting, "running": len(self.log) - waiting,
                "adapters": self.adapters, "kv_bytes": sum(e.kv_bytes for e in self.log), "ticks": self.ticks}

    def tick(self, _=None) -> None:
        now = self.eng.now_s
        self.ticks += 1
        self.balance(now)
        # Any remaining work has an event pending (arrival, iteration end, wake, KV landing); with
        # none, nothing can change any more and ticking on would never end (stuck requests are
        # reported as dropped, as without migration).
        if len(self.eng):
            self.eng.schedule(now + self.interval_s, self.tick)

    def balance(self, now: float) -> None:
        servers = self.servers
        n = len(servers)
        loads = [s.load() for s in servers]
        stuck: set = set()  # sources with nothing movable this tick
        for _ in range(n * n):
            srcs = [i for i in range(n) if i not in stuck]
            if not srcs:
                break
            src = min(srcs, key=lambda i: (-loads[i], i))
            dst = min(range(n), key=lambda i: (loads[i], i))
            gap = loads[src] - loads[dst]
            if gap <= self.threshold:
                break
            moved = self._move(servers[src], servers[dst], gap // 2, now)
            if not moved:
                stuck.add(src)
                continue
            loads[src] -= moved
            loads[dst] += moved

    def _move(self, src: SimServer, dst: SimServer, budget: int, now: float) -> int:
        leaving = {id(r) for r, _, _ in src.outbox}
        groups: dict = {}
        for r in src.sched.waiting:
            groups.setdefault(r.adapter, ([], []))[0].append(r)
        for r in src.sched.running:
            if id(r) not in leaving:
                groups.setdefault(r.adapter, ([], []))[1].append(r)
        groups.pop(src.sched.merged, None)
        if not groups:
            return 0
        room = dst.cfg.max_batch - len(dst.sched.running) - dst.incoming
        # fewest adapter moves per request first; among equal groups, the fewest KV transfers
        order = sorted(groups, key=lambda a: (-(len(groups[a][0]) + len(groups[a][1])), len(groups[a][1]), a))
        picks = []  # (adapter, waiting to move, running to move)
        left = budget
        for a in order:
            w, run = groups[a]
            if len(w) + len(run) > left:
                continue
            run = run[:max(0, room)]
            if not w and not run:
                continue
            room -= len(run)
            left -= len(w) + len(run)
            picks.append((a, w, run))
            if not left:
                break
        if not picks:
            a = next((a for a in order if groups[a][0]), None)
            if a is None:
                return 0
            w = groups[a][0]
            picks.append((a, w[len(w) - min(budget, len(w)):], []))
        key = self.ticks
        moved_w = []
        for a, w, run in picks:
            moved_w.extend(w)
            for r in w:
                self._count(key, a, dst)
                self.log.append(MigrationEvent(r.rid, a, "waiting", src.sid, dst.sid, now, now, 0.0, r.generated))
            for r in run:
                dst.incoming += 1
                if src.busy:
                    src.outbox.append((r, dst, key))
                else:
                    self._handoff(src, r, dst, key, now)
        if moved_w:
            src.take_waiting(moved_w)
            dst.receive_waiting(moved_w, now)
            src._kick(now)  # a blocked queue head may have left
        return sum(len(w) + len(run) for _, w, run in picks)

    def _count(self, key, adapter: str, dst: SimServer) -> None:
        g = (key, adapter, dst.sid)
        if g not in self._groups_seen:
            self._groups_seen.add(g)
            self.adapters += 1

    def ship(self, src: SimServer, now: float) -> None:
        out, src.outbox = src.outbox, []
        for r, dst, key in out:
            self._handoff(src, r, dst, key, now)

    def _handoff(self, src: SimServer, r: SReq, dst: SimServer, key, now: float) -> None:
        running = src.sched.running
        k = next((i for i, x in enumerate(running) if x is r), None)
        if k is None or not dst.sched.pool.can_admit(r.adapter):
            dst.incoming -= 1  # finished meanwhile, or the destination's slots are all pinned: stays
            return
        del running[k]
        src.sched.pool.release(r.adapter)
        src.version += 1
        _, is_new, _ = dst.sched.pool.acquire(r.adapter)
        if is_new:  # the adapter follows its request through the destination's loader
            dst.ready_at.pop(r.adapter, None)
            dst._start_load(r.adapter, r.rank, now)
        c = self.cost
        kv = c.kv_bytes_per_token() * (r.prompt_len + r.generated)
        at = now + c.intra_latency_s + kv / c.intra_bw_bytes_per_s
        self._count(key, r.adapter, dst)
        self.log.append(MigrationEvent(r.rid, r.adapter, "running", src.sid, dst.sid, now, at, kv, r.generated))
        self.eng.schedule(at, dst.land, r)


def simulate(requests: Sequence[SReq], num_servers: int, cfg: SchedulerConfig, cost: ServingCost,
             route: Callable, slo_of: Callable[[SReq], float], preload: Sequence[str] = (),
             progress=None, isolated_of: Optional[Callable[[SReq], float]] = None, lora: bool = True) -> ServingSimResult:
    """``lora=False``: serve the trace on the base model alone (every adapter counted resident,
    no load, no LoRA compute; the SLO reference run, impl/caraserve/README.md "SLO")."""
    eng = EventLoop()
    records: list = []

    def done(server, r, now):
        records.append(RequestRecord(rid=r.rid, adapter=r.adapter, rank=r.rank, arrival_s=r.arrival_s,
                                     first_token_s=r.data["first_s"], done_s=now, output_len=r.output_len,
                                     cold=r.data.get("cold", False), interruptions=r.interruptions,
                                     slo_tpot_s=slo_of(r), server=server.sid,
                                     isolated_s=isolated_of(r) if isolated_of else 0.0,
                                     stall_s=r.data.get("stall_s", 0.0), load_stalls=r.data.get("load_stalls", 0)))
        if progress is not None:
            progress.update(1)

    servers = [SimServer(i, cfg, cost, eng, done, slo_of, lora=lora) for i in range(num_servers)]
    if not lora:
        preload = sorted({r.adapter for r in requests})
        for s in servers:
            s.sched.pool.capacity = max(s.sched.pool.capacity, len(preload))
    for s in servers:
        for a in preload:
            s.sched.pool.preload(a)

    mig = None
    if cfg.policy.migrates and cfg.dlora_migrate and num_servers > 1 and requests:
        mig = Migrator(servers, cost, eng, cfg.dlora_migrate_interval_s, cfg.dlora_migrate_threshold)

    def arrive(r: SReq):
        now = eng.now_s
        i = route(r, servers, now)
        servers[i].arrive(r, now)

    for r in requests:
        eng.schedule(r.arrival_s, arrive, r)
    if mig is not None:
        eng.schedule(min(r.arrival_s for r in requests) + mig.interval_s, mig.tick)
    eng.run()
    makespan = max((r.done_s for r in records), default=0.0) - min((r.arrival_s for r in requests), default=0.0)
    return ServingSimResult(records=sorted(records, key=lambda x: x.rid), arrived=len(requests),
                     dropped=len(requests) - len(records), makespan_s=makespan,
                     stall_s=sum(s.stall_s for s in servers), busy_s=sum(s.busy_s for s in servers),
                     cpu_layers=sum(s.cpu_layers for s in servers), loads=sum(s.loads for s in servers),
                     underpriced=sum(s.underpriced for s in servers),
                     lora_rows=sum(s.lora_rows for s in servers),
                     per_server_busy_s=[s.busy_s for s in servers],
                     iteration_mean_s={k: (sum(s.iter_s[k][0] for s in servers) / n if n else None)
                                       for k in ("prefill", "decode")
                                       for n in [sum(s.iter_s[k][1] for s in servers)]},
                     migrations=(mig.summary() if mig is not None else Migrator.empty()) if cfg.policy.migrates else None,
                     migration_log=mig.log if mig is not None else [])
