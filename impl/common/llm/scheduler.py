"""Iteration-level batch scheduler shared by the real engine and the serving simulator.

The scheduler is plain data + decisions: it never measures or sleeps. Each call to
:meth:`BatchScheduler.plan` returns the next iteration (a prefill batch or a decode batch) and
the adapter actions it needs; the caller (real engine or simulator) executes it and reports
back with :meth:`prefilled`, :meth:`decoded`, :meth:`finished`.

Policies (CaraServe's baselines as the harness builds them, impl/caraserve/README.md):
| policy    | cold adapter at prefill                    | prefill kernel | decode kernel |
|-----------|--------------------------------------------|----------------|---------------|
| cached    | never cold (all preloaded)                 | sgmv           | bgmv          |
| ondmd     | synchronous load, stalls the iteration     | sgmv           | bgmv          |
| caraserve | async load from arrival + CPU-assisted     | sgmv           | bgmv          |
| slora     | async prefetch from arrival, sync remainder| mbgmv          | mbgmv         |
| punica    | synchronous load; ranks 16/32/64 only      | sgmv           | bgmv_punica   |
| dlora     | synchronous load; merged mode when one     | sgmv           | bgmv          |
|           | adapter dominates the batch                |                |               |
| hf_peft   | synchronous load; always merged: one       | (merged)       | (merged)      |
|           | adapter at a time, no cross-adapter batch  |                |               |

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

POLICIES = ("cached", "ondmd", "caraserve", "slora", "punica", "dlora", "hf_peft")
SYNC_LOAD = ("ondmd", "punica", "dlora", "slora", "hf_peft")  # the load is awaited before prefill
ASYNC_AT_ARRIVAL = ("caraserve",)  # S-LoRA prefetches only for the next batch (see plan)
# A request whose prefill ended before its adapter finished loading (CaraServe: the load runs
# beside the CPU-assisted prefill) joins the next decode step, and that step waits for the load
# (the engine and the simulator price the wait as a load stall of the batch). Elsewhere a
# running request decodes only once resident (dLoRA's migrated requests). Holding it out of the
# step instead made the step cheaper than CACHED's with the same requests resident, and
# CaraServe's mean TTFT came out below CACHED's (the order check of impl/caraserve/README.md,
# "The paper's SLO, the MAF popularity stand-in, the kernel law").
DECODE_WAITS_FOR_LOAD = ("caraserve",)
KERNELS = {
    "cached": ("sgmv", "bgmv"), "ondmd": ("sgmv", "bgmv"), "caraserve": ("sgmv", "bgmv"),
    "slora": ("mbgmv", "mbgmv"), "punica": ("sgmv", "bgmv_punica"), "dlora": ("sgmv", "bgmv"),
    "hf_peft": ("sgmv", "bgmv"),  # never used: every iteration runs on merged weights
}
# ``lora_kernels`` other than "auto" (a policy's own pair above): run any policy's scheduling on
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


@dataclass
class SchedulerConfig:
    policy: str = "caraserve"
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
    lora_kernels: str = "auto"  # "auto" = the policy's own (KERNELS), else a KERNEL_FAMILIES key

    def __post_init__(self):
        if self.lora_kernels != "auto" and self.lora_kernels not in KERNEL_FAMILIES:
            raise ConfigError(f"system.lora_kernels: unknown {self.lora_kernels!r} "
                              f"(one of: auto, {', '.join(KERNEL_FAMILIES)})")
        if not self.dlora_migrate_interval_s > 0 or self.dlora_migrate_threshold < 1:
            raise ConfigError("system.dlora_migrate_interval_s must be > 0 and system.dlora_migrate_threshold >= 1 "
                              f"(got {self.dlora_migrate_interval_s}, {self.dlora_migrate_threshold})")


def kernels_of(cfg: SchedulerConfig) -> tuple[str, str]:
    """(prefill, decode) kernel a scheduler with ``cfg`` runs."""
    return KERNELS[cfg.policy] if cfg.lora_kernels == "auto" else KERNEL_FAMILIES[cfg.lora_kernels]


class BatchScheduler:
    def __init__(self, cfg: SchedulerConfig):
        if cfg.policy not in POLICIES:
            raise ConfigError(f"system.policy: unknown policy {cfg.policy!r} (one of: {', '.join(POLICIES)})")
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
        if self.cfg.policy in ASYNC_AT_ARRIVAL and len(self.waiting) <= self._window():
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
        if self.cfg.policy in ASYNC_AT_ARRIVAL and self.unpinned and self.pool.has_free_slot():
            for k, r in enumerate(self.waiting):
                if k >= self._window():
                    break
                if not r.pinned:
                    a = self._pin(r)
                    if a is not None:
                        out.append(a)
        return out

    # ---- decisions -----------------------------------------------------------------------
    def _dlora_mode(self) -> Optional[str]:
        counts: dict[str, int] = {}
        for r in list(self.waiting) + self.running:
            counts[r.adapter] = counts.get(r.adapter, 0) + 1
        total = sum(counts.values())
        if not total:
            return None
        top = min(counts, key=lambda a: (-counts[a], a))
        if counts[top] >= self.cfg.dlora_merge_min and counts[top] / total >= self.cfg.dlora_merge_share:
            return top
        return None

    def _hf_peft_adapter(self) -> Optional[str]:
        """HF-PEFT serves one merged adapter at a time: the running batch's, else the queue head's."""
        if self.running:
            return self.running[0].adapter
        return self.waiting[0].adapter if self.waiting else None

    def plan(self, decode_ready: Callable[[SReq], bool]) -> Optional[IterationPlan]:
        """Prefill first (LightLLM/vLLM default), else one decode step of the ready running set."""
        cfg = self.cfg
        if cfg.policy == "dlora":
            self.merged = self._dlora_mode()
        elif cfg.policy == "hf_peft":
            self.merged = self._hf_peft_adapter()
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
        if self.cfg.policy != "slora":
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
