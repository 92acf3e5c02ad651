"""Iteration-level batch scheduler shared by the real engine and the serving simulator.

The scheduler is plain data + decisions: it never measures or sleeps. Each call to
:meth:`BatchScheduler.plan` returns the next iteration (a prefill batch or a decode batch) and
the adapter actions it needs; the caller (real engine or simulator) executes it and reports
back with :meth:`prefilled`, :meth:`decoded`, :meth:`finished`.

A :class:`ServingPolicy` says what a server does with adapters (when a cold one loads, which
kernels run, whether the weights are merged); a serving system registers its policies by name
(CaraServe's and its baselines': impl/caraserve/policies.py) and hands the component in, so this
module and the engine and simulator that run it know no policy by name.

``evict_on_finish`` (S-LoRA's public code): whenever a request finishes, every adapter
that no running or pinned queued request uses is evicted, so an arrival misses unless its
adapter is in use or already in flight. Otherwise the pool keeps adapters until LRU needs a slot.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from impl.common.api import ConfigError
from impl.common.llm.pool import AdapterPool


# ``lora_kernels`` other than "auto" (a policy's own pair): run any policy's scheduling on
# one system's kernels, e.g. CaraServe's servers on S-LoRA's (CaraServe v1's scheduler
# simulation reports both).
KERNEL_FAMILIES = {"punica": ("sgmv", "bgmv"), "slora": ("mbgmv", "mbgmv")}


@dataclass
class SReq:
    """A request as the scheduler sees it (engine/simulator keep their own payload in ``data``)."""

    rid: int
    arrival_s: float
    adapter: str
    rank: int
    prompt_len: int
    output_len: int
    pinned: bool = False
    generated: int = 0
    interruptions: int = 0
    data: object = None


@dataclass
class IterationPlan:
    kind: str  # prefill | decode
    reqs: list
    new_adapters: list = field(default_factory=list)  # acquired now, need a load (sync or async)
    prefetch: list = field(default_factory=list)  # S-LoRA: next batch's adapters, loaded async
    merged: Optional[str] = None  # dLoRA merged-mode adapter


def dominant_adapter(sched: "BatchScheduler") -> Optional[str]:
    """Merged mode while one adapter holds ``dlora_merge_share`` of the queued and running
    requests (and at least ``dlora_merge_min`` of them), else none."""
    counts: dict[str, int] = {}
    for r in list(sched.waiting) + sched.running:
        counts[r.adapter] = counts.get(r.adapter, 0) + 1
    total = sum(counts.values())
    if not total:
        return None
    top = min(counts, key=lambda a: (-counts[a], a))
    if counts[top] >= sched.cfg.dlora_merge_min and counts[top] / total >= sched.cfg.dlora_merge_share:
        return top
    return None


def serving_adapter(sched: "BatchScheduler") -> Optional[str]:
    """Always merged, one adapter at a time: the running batch's, else the queue head's."""
    if sched.running:
        return sched.running[0].adapter
    return sched.waiting[0].adapter if sched.waiting else None


@dataclass(frozen=True)
class ServingPolicy:
    """What a serving policy does with adapters."""

    # (prefill, decode) LoRA kernels of its own (lora_kernels="auto")
    kernels: tuple[str, str] = ("sgmv", "bgmv")
    # every adapter of the trace resident before the first request; never evicts
    preload_all: bool = False
    # a cold adapter's load is awaited before the prefill that needs it
    sync_load: bool = False
    # a cold adapter loads in the background from the moment it holds a slot (at arrival, for a
    # request that can join the next batches), and the prefill does not wait for it
    async_load: bool = False
    # a cold prefill layer runs its LoRA part on the CPU until the layer's group is resident
    cpu_assisted_prefill: bool = False
    # A request whose prefill ended before its adapter finished loading (the load runs beside the
    # CPU-assisted prefill) joins the next decode step, and that step waits for the load (the
    # engine and the simulator price the wait as a load stall of the batch). Otherwise a running
    # request decodes only once resident (dLoRA's migrated requests). Holding it out of the step
    # instead made the step cheaper than a preloaded server's with the same requests resident,
    # and CaraServe's mean TTFT came out below CACHED's (the order check of impl/caraserve/README.md,
    # "The paper's SLO, the MAF popularity stand-in, the kernel law").
    decode_waits_for_load: bool = False
    # while an iteration runs, the adapters of the requests that can join the next batch load
    prefetch_next_batch: bool = False
    # the adapter the weights are merged with before each iteration (None: unmerged, LoRA kernels)
    merged_adapter: Optional[Callable[["BatchScheduler"], Optional[str]]] = None
    # False: always on merged weights, no LoRA compute priced
    lora_compute: bool = True
    # the adapter copy moves the full A+B bytes for A and again for B (S-LoRA's public code)
    loads_ab_twice: bool = False
    # requests and their adapters move between servers (sim, more than one server)
    migrates: bool = False


# Every adapter resident from the start, loaded on the device with no wait and never evicted: the
# upper bound of a serving comparison, and how the base-model reference run schedules.
PRELOADED = ServingPolicy(preload_all=True)


@dataclass
class SchedulerConfig:
    policy: ServingPolicy
    max_batch: int = 32
    max_prefill_tokens: int = 4096
    pool_slots: int = 8
    load_groups: int = 1
    dlora_merge_share: float = 0.6
    dlora_merge_min: int = 4
    # dLoRA request-adapter co-migration between servers; read only by the simulator
    # (impl/common/servesim/cluster.py), the real engine is one server.
    dlora_migrate: bool = True
    dlora_migrate_interval_s: float = 0.5
    dlora_migrate_threshold: int = 4
    evict_on_finish: bool = False
    lora_kernels: str = "auto"  # "auto" = the policy's own kernels, else a KERNEL_FAMILIES key

    def __post_init__(self):
        if self.lora_kernels != "auto" and self.lora_kernels not in KERNEL_FAMILIES:
            raise ConfigError(f"system.lora_kernels: unknown {self.lora_kernels!r} "
                              f"(one of: auto, {', '.join(KERNEL_FAMILIES)})")
        if not self.dlora_migrate_interval_s > 0 or self.dlora_migrate_threshold < 1:
            raise ConfigError("system.dlora_migrate_interval_s must be > 0 and system.dlora_migrate_threshold >= 1 "
                              f"(got {self.dlora_migrate_interval_s}, {self.dlora_migrate_threshold})")


def kernels_of(cfg: SchedulerConfig) -> tuple[str, str]:
    """(prefill, decode) kernel a scheduler with ``cfg`` runs."""
    return cfg.policy.kernels if cfg.lora_kernels == "auto" else KERNEL_FAMILIES[cfg.lora_kernels]


class BatchScheduler:
    def __init__(self, cfg: SchedulerConfig):
        if cfg.max_batch < 1:
            raise ConfigError(f"system.max_batch must be >= 1, got {cfg.max_batch}")
        self.cfg = cfg
        self.pool = AdapterPool(cfg.pool_slots, cfg.load_groups)
        self.waiting: deque = deque()
        self.running: list = []
        self.merged: Optional[str] = None
        self.unpinned = 0  # queued requests without a pinned adapter slot
        self.evicted: list = []  # evict_on_finish: adapters dropped (the caller may drain it)
        self.prefill_kernel, self.decode_kernel = kernels_of(cfg)

    # ---- events --------------------------------------------------------------------------
    def arrive(self, r: SReq) -> Optional[str]:
        """Queue ``r``. Returns the adapter to start loading now (async policies), if any."""
        self.waiting.append(r)
        self.unpinned += 1
        if self.cfg.policy.async_load and len(self.waiting) <= self._window():
            return self._pin(r)
        return None

    def _window(self) -> int:
        """Async loads start only for requests that can join the next batches (a deep queue
        pinning slots far ahead would starve its own head)."""
        return max(1, self.cfg.max_batch - len(self.running))

    def _pin(self, r: SReq) -> Optional[str]:
        """Pin r's adapter if a slot is available; returns the adapter if it is new (needs a load)."""
        if r.pinned or not self.pool.can_admit(r.adapter):
            return None
        entry, is_new, _ = self.pool.acquire(r.adapter)
        r.pinned = True
        self.unpinned -= 1
        return r.adapter if is_new else None

    def retry_pins(self) -> list[str]:
        """Async policies: pin queued requests that found the pool full at arrival."""
        out = []
        if self.cfg.policy.async_load and self.unpinned and self.pool.has_free_slot():
            for k, r in enumerate(self.waiting):
                if k >= self._window():
                    break
                if not r.pinned:
                    a = self._pin(r)
                    if a is not None:
                        out.append(a)
        return out

    # ---- decisions -----------------------------------------------------------------------
    def plan(self, decode_ready: Callable[[SReq], bool]) -> Optional[IterationPlan]:
        """Prefill first (LightLLM/vLLM default), else one decode step of the ready running set."""
        cfg = self.cfg
        if cfg.policy.merged_adapter is not None:
            self.merged = cfg.policy.merged_adapter(self)
        sel, tokens, new = [], 0, []
        for r in list(self.waiting):
            if len(self.running) + len(sel) >= cfg.max_batch:
                break
            if self.merged is not None and r.adapter != self.merged:
                continue
            if sel and tokens + r.prompt_len > cfg.max_prefill_tokens:
                break
            if not r.pinned:
                if not self.pool.can_admit(r.adapter):
                    if self.running or sel:
                        break  # FIFO: wait for a running request to free a slot
                    continue  # nothing will free a slot: let pinned requests behind go first
                a = self._pin(r)
                if a is not None:
                    new.append(a)
            sel.append(r)
            tokens += r.prompt_len
        if sel:
            for r in sel:
                self.waiting.remove(r)
            return IterationPlan("prefill", sel, new_adapters=new, merged=self.merged, prefetch=self._prefetch(len(sel)))
        ready = [r for r in self.running if decode_ready(r) and (self.merged is None or r.adapter == self.merged)]
        if ready:
            return IterationPlan("decode", ready, merged=self.merged, prefetch=self._prefetch(0))
        return None

    def _prefetch(self, joining: int) -> list:
        """S-LoRA: while this iteration runs, load the adapters of the requests that can join
        the next batch (queue head, up to the free batch slots)."""
        if not self.cfg.policy.prefetch_next_batch:
            return []
        out = []
        room = self.cfg.max_batch - len(self.running) - joining
        for k, r in enumerate(self.waiting):
            if k >= room:
                break
            if not r.pinned:
                a = self._pin(r)
                if a is not None:
                    out.append(a)
        return out

    # ---- bookkeeping ---------------------------------------------------------------------
    def prefilled(self, plan: IterationPlan) -> list[SReq]:
        """After a prefill iteration: every in-flight decode was interrupted once."""
        for r in self.running:
            r.interruptions += 1
        done = []
        for r in plan.reqs:
            r.generated = 1
            if r.generated >= r.output_len:
                done.append(r)
            else:
                self.running.append(r)
        for r in done:
            self.pool.release(r.adapter)
        self._evict_after(done)
        return done

    def _evict_after(self, done: list) -> None:
        if done and self.cfg.evict_on_finish:
            self.evicted.extend(self.pool.evict_unpinned())

    def decoded(self, plan: IterationPlan) -> list[SReq]:
        done = []
        for r in plan.reqs:
            r.generated += 1
            if r.generated >= r.output_len:
                done.append(r)
        if done:
            ids = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in ids]
            for r in done:
                self.pool.release(r.adapter)
        self._evict_after(done)
        return done

    def busy(self) -> bool:
        return bool(self.waiting or self.running)
