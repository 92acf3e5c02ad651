"""Real-mode serving engine: continuous batching over the ragged Llama forward, an adapter pool
with LRU eviction and pinning, a layer-group loader, and (CaraServe) CPU-assisted prefill.

One main thread runs iterations (the "device"); a loader thread moves adapters group by group
(a real copy to the device on CUDA; on a CPU-only host a clone plus a sleep for the emulated
transfer time, labelled emulated by the caller); the CPU LoRA worker is a separate process.
The batch decisions come from :class:`~impl.common.llm.scheduler.BatchScheduler`, the same
code the simulator uses.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from impl.common.llm.forward import CPUPath, InlineCPU, RequestSlice, KVCache, ragged_forward
from impl.common.llm.kernels import check_kernel_rank
from impl.common.llm.lora import HostAdapter, LoRABatch, group_of_layer, layer_groups, merge_adapter, unmerge_adapter
from impl.common.llm.metrics import RequestRecord
from impl.common.llm.model import SITES
from impl.common.llm.scheduler import PRELOADED, BatchScheduler, IterationPlan, SchedulerConfig, SReq


@dataclass
class EngineRequest:
    rid: int
    arrival_s: float
    adapter: str
    prompt: list
    output_len: int
    slo_tpot_s: float = float("inf")


class Loader:
    """Host -> device adapter copies, FIFO over one link, layer group by layer group.

    On CUDA (``device``, the job's decision) each group is copied from the pinned host stacks
    with ``non_blocking`` copies on a side stream, in the model's ``dtype``; the group is marked
    resident only after an event on that stream completes, and every copy is recorded on the
    serving stream so that the allocator never reuses its memory while a kernel there may still
    read it. On a CPU job the copy is a clone (plus the emulated transfer time)."""

    def __init__(self, adapters: dict[str, HostAdapter], sched: BatchScheduler, num_layers: int, groups: int,
                 device: torch.device, seconds_for: Optional[Callable[[str], float]] = None,
                 dtype: Optional[torch.dtype] = None):
        self.adapters, self.sched, self.device, self.dtype = adapters, sched, device, dtype
        self.groups = layer_groups(num_layers, groups)
        self.seconds_for = seconds_for  # emulated transfer time (CPU host); None = real copy time only
        self.dev: dict[str, dict] = {}
        self.q: "queue.Queue" = queue.Queue()
        self.inflight: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.serving_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        self.loads = 0
        self.load_s = 0.0
        self.times: list = []  # (adapter, seconds) per completed copy

    def _copy(self, name: str) -> None:
        ad = self.adapters[name]
        entry = self.sched.pool.get(name)
        t_total = self.seconds_for(name) if self.seconds_for else 0.0
        store = {s: [None] * ad.num_layers for s in SITES}
        self.dev[name] = store
        t_start = time.perf_counter()
        dtype = self.dtype or ad.dtype
        for g, layers in enumerate(self.groups):
            t0 = time.perf_counter()
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    for s in SITES:
                        for l in layers:
                            pair = (ad.A[s][l].to(self.device, dtype, non_blocking=True),
                                    ad.B[s][l].to(self.device, dtype, non_blocking=True))
                            for t in pair:
                                t.record_stream(self.serving_stream)
                            store[s][l] = pair
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                ev.synchronize()
            else:
                for s in SITES:
                    for l in layers:
                        store[s][l] = (ad.A[s][l].to(dtype=dtype, copy=True), ad.B[s][l].to(dtype=dtype, copy=True))
            if t_total:
                left = t_total * len(layers) / ad.num_layers - (time.perf_counter() - t0)
                if left > 0:
                    time.sleep(left)
            if entry is not None:
                entry.ready[g] = True
        self.loads += 1
        self.load_s += time.perf_counter() - t_start
        self.times.append((name, time.perf_counter() - t_start))

    def _loop(self) -> None:
        while True:
            name = self.q.get()
            if name is None:
                return
            try:
                while True:
                    entry = self.sched.pool.get(name)
                    self._copy(name)
                    with self.lock:
                        # evicted and re-acquired while copying: the new slot needs its own copy
                        again = self.sched.pool.get(name) is not entry and self.sched.pool.get(name) is not None
                    if not again:
                        break
            finally:
                with self.lock:
                    ev = self.inflight.pop(name, None)
                if ev is not None:
                    ev.set()

    def start(self, name: str) -> None:
        with self.lock:
            if name in self.inflight:
                return
            self.inflight[name] = threading.Event()
        self.q.put(name)

    def wait(self, name: str) -> float:
        """Block until ``name`` is resident (sync load if nothing is in flight). Returns the stall."""
        t0 = time.perf_counter()
        with self.lock:
            ev = self.inflight.get(name)
        if ev is not None:
            ev.wait()
        else:
            entry = self.sched.pool.get(name)
            if entry is None or not entry.resident():
                self._copy(name)
        return time.perf_counter() - t0

    def weights(self, name: str, site: str, layer: int):
        return self.dev[name][site][layer]

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=5)


@dataclass
class EngineStats:
    records: list = field(default_factory=list)
    arrived: int = 0
    dropped: int = 0
    makespan_s: float = 0.0
    stall_s: float = 0.0
    busy_s: float = 0.0
    # The serving thread's own CPU time over its iterations: busy_cpu_s / busy_s well under 1
    # means the thread sat off-CPU mid-iteration (preempted, or waiting on a worker or the GIL).
    busy_cpu_s: float = 0.0
    prefill_iters: int = 0
    decode_iters: int = 0
    cpu_jobs: int = 0
    cpu_layers: int = 0
    device_layers: int = 0
    # LoRA work: request rows of iterations that ran a LoRA delta (device or CPU path), and the
    # adapter loads the loader ran during the trace (the base-only SLO reference run: both 0)
    lora_rows: int = 0
    loads: int = 0
    # one row per prefill iteration: (request ids, wall s, layers on the CPU path)
    prefill_log: list = field(default_factory=list)
    # (adapter, seconds) per adapter copy of the trace: measured H2D on CUDA, emulated on a CPU job
    load_times: list = field(default_factory=list)


class ServingEngine:
    def __init__(self, model, adapters: dict[str, HostAdapter], cfg: SchedulerConfig, *,
                 seconds_for: Optional[Callable[[str], float]] = None, cpu=None, device: str = "cpu",
                 check_residency: bool = True, lora: bool = True):
        """``lora=False``: the base model alone (the SLO reference run; the paper's SLO is
        1.5x the per-token latency without LoRA, impl/caraserve/README.md "SLO"): the
        scheduler runs as CACHED with every adapter counted resident and nothing copied, and no
        iteration computes a LoRA delta."""
        self.model = model
        self.adapters = adapters
        cfg = dataclasses.replace(cfg, load_groups=min(cfg.load_groups, model.config.num_hidden_layers))
        self.lora = lora
        if not lora:
            cfg = dataclasses.replace(cfg, policy=PRELOADED, evict_on_finish=False)
            cpu = None
        self.cfg = cfg
        self.sched = BatchScheduler(cfg)
        if self.sched.decode_kernel == "bgmv_punica":
            for name, ad in adapters.items():
                check_kernel_rank("bgmv_punica", ad.rank, f"adapter {name!r}")
        self.device = torch.device(device)
        where = model.model.embed_tokens.weight.device
        if where.type != self.device.type:
            raise ValueError(f"serving engine: the model is on {where}, the engine's device is {self.device}")
        # the device copies take the model's dtype (host stacks may be fp32 or the model's own)
        self.dtype = model.model.embed_tokens.weight.dtype
        self.num_layers = model.config.num_hidden_layers
        self.group_of = group_of_layer(self.num_layers, cfg.load_groups)
        self.loader = Loader(adapters, self.sched, self.num_layers, cfg.load_groups, self.device, seconds_for,
                             dtype=self.dtype)
        if cpu is None and cfg.policy.cpu_assisted_prefill:
            cpu = InlineCPU(adapters)  # cpu_workers: 0 -> the CPU path runs in-process
        self.cpu = cpu
        self.check_residency = check_residency
        self.merged: Optional[str] = None
        self._saved = None
        if cfg.policy.preload_all:
            self.sched.pool.capacity = max(self.sched.pool.capacity, len(adapters))
            for name in adapters:
                self.sched.pool.preload(name)
                if lora:
                    self._copy_now(name)
        self.loader.loads = 0  # count the trace's loads only
        self.loader.times = []

    def _copy_now(self, name: str) -> None:
        keep, self.loader.seconds_for = self.loader.seconds_for, None
        try:
            self.loader._copy(name)
        finally:
            self.loader.seconds_for = keep

    def close(self) -> None:
        self.loader.close()
        if self._saved is not None:
            unmerge_adapter(self.model, self._saved)
            self._saved = None

    # ---- one iteration -------------------------------------------------------------------
    def _lora_batch(self, reqs: Sequence[SReq], kernel: str) -> tuple[LoRABatch, list[str]]:
        names = sorted({r.adapter for r in reqs})
        slot = {n: i for i, n in enumerate(names)}
        rows, segs = [], []
        for r in reqs:
            n = len(r.data["pending"])
            rows += [slot[r.adapter]] * n
            segs.append((slot[r.adapter], n))
        pool = self.sched.pool

        def check(s, layer):
            if self.check_residency:
                pool.check_resident(names[s], self.group_of[layer])

        b = LoRABatch(adapters=[self.adapters[n] for n in names], row_adapter=torch.tensor(rows, dtype=torch.long),
                      segments=segs, kernel=kernel, device_check=check,
                      device_weights=lambda s, site, layer: self.loader.weights(names[s], site, layer))
        return b, names

    def _run(self, plan: IterationPlan, stats: EngineStats) -> None:
        reqs = plan.reqs
        if plan.merged != self.merged:  # dLoRA mode switch: merge / unmerge (copy back)
            if self._saved is not None:
                unmerge_adapter(self.model, self._saved)
                self._saved = None
            if plan.merged is not None:
                stats.stall_s += self.loader.wait(plan.merged)
                self._saved = merge_adapter(self.model, self.adapters[plan.merged])
            self.merged = plan.merged
        for a in plan.prefetch:  # S-LoRA: next batch's adapters load while this iteration runs
            self.loader.start(a)
        items = [RequestSlice(r.data["pending"], r.data["cache"]) for r in reqs]
        cpu_path = None
        if plan.kind == "prefill":
            pol = self.cfg.policy
            for a in plan.new_adapters:
                if pol.async_load:
                    self.loader.start(a)
            for r in reqs:
                entry = self.sched.pool.get(r.adapter)
                r.data["cold"] = not entry.resident()
            if pol.sync_load:
                for a in sorted({r.adapter for r in reqs}):
                    if not self.sched.pool.get(a).resident():
                        stats.stall_s += self.loader.wait(a)
            batch, names = self._lora_batch(reqs, self.sched.prefill_kernel)
            if pol.cpu_assisted_prefill and self.cpu is not None:
                pool = self.sched.pool
                decided: dict = {}

                def decide(s, layer):
                    g = self.group_of[layer]
                    key = (s, g)
                    if key not in decided:  # switch only at a layer-group boundary
                        decided[key] = not pool.get(names[s]).ready[g]
                    is_cpu = decided[key]
                    if is_cpu:
                        stats.cpu_layers += 1
                    else:
                        stats.device_layers += 1
                    return is_cpu

                cpu_path = CPUPath(decide, lambda s, layer, sites, x: self.cpu.submit(names[s], layer, sites, x))
        else:
            if self.cfg.policy.decode_waits_for_load:
                # a request whose prefill ended before its adapter finished loading: the step
                # waits for the load (decode never runs on the CPU path), a stall of the batch
                for a in sorted({r.adapter for r in reqs}):
                    if not self.sched.pool.get(a).resident():
                        stats.stall_s += self.loader.wait(a)
            batch, names = self._lora_batch(reqs, self.sched.decode_kernel)
        if plan.merged is not None or not self.lora:
            batch = None  # merged weights / the base model alone: no separate LoRA compute
        if batch is not None:
            stats.lora_rows += len(reqs)
        logits = ragged_forward(self.model, items, batch, cpu_path)
        nxt = logits.argmax(-1).tolist()
        for r, t in zip(reqs, nxt):
            r.data["tokens"].append(int(t))
            r.data["pending"] = [int(t)]

    # ---- the serving loop ----------------------------------------------------------------
    def serve(self, requests: Sequence[EngineRequest], progress=None, clock=time.perf_counter) -> EngineStats:
        stats = EngineStats(arrived=len(requests))
        pending = sorted(requests, key=lambda q: (q.arrival_s, q.rid))
        for q in pending:
            if q.adapter not in self.adapters:
                raise KeyError(f"request {q.rid}: unknown adapter id {q.adapter!r}")
        i = 0
        sched = self.sched
        t0 = clock()
        done = 0
        busy = 0.0
        while done < len(pending):
            now = clock() - t0
            for a in sched.retry_pins():
                self.loader.start(a)
            while i < len(pending) and pending[i].arrival_s <= now:
                q = pending[i]
                sr = SReq(rid=q.rid, arrival_s=q.arrival_s, adapter=q.adapter, rank=self.adapters[q.adapter].rank,
                          prompt_len=len(q.prompt), output_len=q.output_len,
                          data={"req": q, "pending": list(q.prompt), "cache": KVCache(), "tokens": [], "cold": False})
                a = sched.arrive(sr)
                if a is not None:
                    self.loader.start(a)
                i += 1
            if self.cfg.policy.decode_waits_for_load:
                plan = sched.plan(lambda r: True)  # the decode step waits for the load (_run)
            else:
                plan = sched.plan(lambda r: sched.pool.get(r.adapter).resident())
            if plan is None:
                nxt = pending[i].arrival_s if i < len(pending) else None
                wait = 0.0005 if nxt is None else max(0.0, min(nxt - now, 0.0005 if sched.busy() else 1.0))
                time.sleep(wait)
                continue
            it0, cpu0, cl0 = clock(), time.thread_time(), stats.cpu_layers
            self._run(plan, stats)
            t_end = clock() - t0
            busy += clock() - it0
            if plan.kind == "prefill":
                stats.prefill_log.append(([r.rid for r in plan.reqs], clock() - it0, stats.cpu_layers - cl0))
            stats.busy_cpu_s += time.thread_time() - cpu0
            if plan.kind == "prefill":
                stats.prefill_iters += 1
                for r in plan.reqs:
                    r.data["first_s"] = t_end
                finished = sched.prefilled(plan)
            else:
                stats.decode_iters += 1
                finished = sched.decoded(plan)
            for r in finished:
                q = r.data["req"]
                stats.records.append(RequestRecord(
                    rid=q.rid, adapter=q.adapter, rank=r.rank, arrival_s=q.arrival_s, first_token_s=r.data["first_s"],
                    done_s=t_end, output_len=q.output_len, cold=r.data["cold"], interruptions=r.interruptions,
                    slo_tpot_s=q.slo_tpot_s))
                r.data["cache"] = None
                done += 1
                if progress is not None:
                    progress.update(1)
        stats.makespan_s = clock() - t0
        stats.busy_s = busy
        stats.loads = self.loader.loads
        stats.load_times = list(self.loader.times)
        if self.cpu is not None:
            stats.cpu_jobs = self.cpu.jobs
        return stats


def run_alone(model, adapters: dict, adapter: Optional[str], prompt: Sequence[int], steps: int,
              switch_layer: Optional[int] = None, cpu=None, kernel: str = "sgmv"):
    """One request, greedy, through the ragged forward; layers < ``switch_layer`` of the prefill
    take the CPU path (``cpu``, which holds its own host adapters). Returns (prefill logits,
    tokens, cache). Used by the switch invariant. ``adapters`` feed the device path: resident
    copies where the model is (:meth:`HostAdapter.to`), not the host stacks of a CUDA job."""
    cache = KVCache()
    names = [adapter] if adapter else []
    def mk(n):
        return LoRABatch(adapters=[adapters[a] for a in names], row_adapter=torch.tensor([0 if names else -1] * n),
                         segments=[(0 if names else -1, n)], kernel=kernel)
    cpu_path = None
    if switch_layer is not None and names:
        cpu_path = CPUPath(lambda s, l: l < switch_layer, lambda s, l, sites, x: cpu.submit(names[s], l, sites, x))
    logits = ragged_forward(model, [RequestSlice(list(prompt), cache)], mk(len(prompt)), cpu_path)
    first = logits.clone()
    toks = [int(logits.argmax(-1)[0])]
    for _ in range(steps - 1):
        logits = ragged_forward(model, [RequestSlice([toks[-1]], cache)], mk(1))
        toks.append(int(logits.argmax(-1)[0]))
    return first, toks, cache


def time_decode_batches(model, adapters: dict, names: Sequence[str], prompt: Sequence[int], sizes: Sequence[int],
                        kernel: str, reps: int = 5) -> dict[int, float]:
    """Median wall time of one decode iteration at each batch size in ``sizes``: ``B`` requests
    (row ``i`` on adapter ``names[i % len(names)]``), each after a prefill of ``prompt``, through
    the ragged forward with the engine's decode ``kernel``; ``reps`` timed steps each (after one
    untimed step), the sizes interleaved so that a burst of foreign load hits all of them alike.
    The serving engine's per-row work (one attention and KV append per request per layer, the
    batch's LoRA gather and padded stack) is what a batch-1 step cannot show."""
    import statistics

    sizes = sorted(set(int(b) for b in sizes))
    rows = [names[i % len(names)] for i in range(max(sizes))]
    caches = []
    for a in rows:
        _, toks, cache = run_alone(model, adapters, a, prompt, 1)
        caches.append((cache, toks[-1]))
    runs = {}
    for B in sizes:
        used = sorted(set(rows[:B]))
        slot = {a: i for i, a in enumerate(used)}
        batch = LoRABatch(adapters=[adapters[a] for a in used],
                          row_adapter=torch.tensor([slot[a] for a in rows[:B]], dtype=torch.long),
                          segments=[(slot[a], 1) for a in rows[:B]], kernel=kernel)
        # every size decodes from its own view of the prefilled caches (KVCache.append never
        # writes in place)
        runs[B] = (batch, [RequestSlice([tok], KVCache(layers=list(c.layers))) for c, tok in caches[:B]], [])
    for k in range(reps + 1):
        for B in sizes:
            batch, items, times = runs[B]
            t0 = time.perf_counter()
            logits = ragged_forward(model, items, batch)
            if logits.is_cuda:  # the step's kernels, not their launch
                torch.cuda.synchronize(logits.device)
            dt = time.perf_counter() - t0
            runs[B] = (batch, [RequestSlice([int(t)], it.cache) for it, t in zip(items, logits.argmax(-1).tolist())], times)
            if k:
                times.append(dt)
    return {B: statistics.median(runs[B][2]) for B in sizes}


def time_cpu_assisted_prefills(model, adapters: dict, cfg: SchedulerConfig, names: Sequence[str],
                               prompt: Sequence[int], seconds_for: Optional[Callable[[str], float]], cpu,
                               device: str = "cpu", reps: int = 1, idle_s: float = 0.0) -> list[dict]:
    """One isolated cold prefill per adapter in ``names`` through the serving engine (``cfg``'s
    policy, CaraServe: the loader copies the adapter group by group while the CPU worker ``cpu``
    computes the LoRA part of the layers whose group is not resident yet), then the same prefill
    on the same engine once the adapter is resident (the device path). Per adapter: the two
    prefill iterations' wall time (``cold_s``, ``warm_s``), their serving-thread CPU time, and
    how many layers the cold one ran on the CPU path (``cpu_layers``; the warm one ran none).
    ``reps`` rounds over ``names``, each pair on a fresh engine (so the adapter is cold again).
    ``idle_s``: the host idles this long before each of the two prefills, as a trace's requests
    arrive after a gap (a cold prefill's hand-off to a worker that has slept costs more)."""
    out = []
    for name in [n for _ in range(reps) for n in names]:
        eng = ServingEngine(model, adapters, cfg, seconds_for=seconds_for, cpu=cpu, device=device)
        try:
            runs = []
            for rid in (0, 1):
                if idle_s > 0:
                    time.sleep(idle_s)
                st = eng.serve([EngineRequest(rid=rid, arrival_s=0.0, adapter=name, prompt=list(prompt), output_len=1)])
                runs.append(st)
                eng.loader.wait(name)  # the copy finishes before the device-path prefill
        finally:
            eng.close()
        cold, warm = runs
        if warm.cpu_layers or warm.stall_s:
            raise RuntimeError(f"adapter {name!r}: the resident prefill ran {warm.cpu_layers} CPU layers and stalled "
                               f"{warm.stall_s:.4f} s (evicted between the two prefills?)")
        out.append({"adapter": name, "rank": int(adapters[name].rank), "cold_s": cold.busy_s, "warm_s": warm.busy_s,
                    "cold_cpu_s": cold.busy_cpu_s, "warm_cpu_s": warm.busy_cpu_s, "cpu_layers": cold.cpu_layers})
    return out
