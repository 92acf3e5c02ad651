"""Request-level diffusion serving simulator (README.md, "Sim results"): GPUs as servers, ControlNet
pool, caches, add-on loads, costs from :class:`impl.swiftdiffusion.profile.SimProfile`.

Requests are planned in arrival order, strict FIFO (a request starts no earlier than the one
before it), so every cache decision happens in time order:

* **Diffusers**: ``gpus`` single-GPU replicas, each request to the replica free first; per
  replica an LRU of ControlNets (GPU memory) and of loaded LoRAs. ControlNets run serially
  (each adds its per-step cost); a ControlNet miss loads it first; a LoRA miss fetches it and
  runs load_lora_weights+fuse, a hit still pays set_adapters+fuse+unfuse.
* **Katz**: base replicas of 2 GPUs (latent parallelism) plus ``cn_servers`` ControlNet GPUs,
  each with ``slots`` concurrent branch slots (a server shares its GPU across base workers
  while a branch step fits in the down half) and an LRU of ControlNets. A request's k
  ControlNets take 2k slots (one per CFG branch) at once; a miss loads the ControlNet before
  the request starts (never used before it loads); an entry in use is never evicted. LoRAs
  load under BAL (patch at min(loaded, K)) from a per-replica host LRU or the remote store.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from impl.common.api import ConfigError

from impl.swiftdiffusion.cache import LRUCache
from impl.swiftdiffusion.profile import SimProfile


@dataclass
class Done:
    arrival: float
    start: float
    end: float
    n_cn: int
    n_lora: int
    cn_ready: float = 0.0  # when the last of its ControlNets was loaded
    cn_misses: int = 0
    lora_misses: int = 0

    @property
    def latency(self) -> float:
        return self.end - self.arrival


@dataclass
class DiffusionSimResult:
    done: list
    max_cn_cache: int = 0
    cn_capacity: int = 0
    lora_capacity: int = 0
    max_lora_cache: int = 0
    arrived: int = 0

    def latencies(self, warmup_frac: float = 0.1) -> np.ndarray:
        lat = np.array([d.latency for d in self.done])
        return lat[int(len(lat) * warmup_frac):]

    def p99(self) -> float:
        return float(np.percentile(self.latencies(), 99))

    def mean(self) -> float:
        return float(self.latencies().mean())


def simulate_diffusers(reqs, prof: SimProfile, gpus: int, cn_cache: int = 2, lora_cache: int = 4,
                       lora_source: str = "remote", skip_steps: int = 0, hit_rate: float = 1.0,
                       seed: int = 0) -> DiffusionSimResult:
    """Diffusers replicas; ``skip_steps`` > 0 makes it Nirvana-like approximate caching: a request
    whose prompt hits the cache (probability ``hit_rate``, seeded) starts from a cached similar
    result and skips that many denoising steps."""
    if gpus < 1:
        raise ConfigError(f"workload.sim.gpus must be >= 1, got {gpus}")
    if not 0 <= skip_steps < prof.steps:
        raise ConfigError(f"system.nirvana_k (steps skipped) must be in 0..{prof.steps - 1}, got {skip_steps}")
    if not 0.0 <= hit_rate <= 1.0:
        raise ConfigError(f"system.nirvana_hit_rate must be in [0, 1], got {hit_rate}")
    rng = np.random.default_rng(seed)
    free = [0.0] * gpus
    cns = [LRUCache(cn_cache, "system.diffusers_cn_cache") for _ in range(gpus)]
    los = [LRUCache(lora_cache, "system.diffusers_lora_cache") for _ in range(gpus)]
    out, prev, mx_c, mx_l = [], 0.0, 0, 0
    for r in reqs:
        g = min(range(gpus), key=lambda i: free[i])
        start = max(r.t, free[g], prev)
        s = prof.diffusers_latency(len(r.controlnets), 0)
        if skip_steps and rng.random() < hit_rate:
            s = prof.nirvana_latency(len(r.controlnets), 0, skip_steps)
        cm = lm = 0
        for c in r.controlnets:
            if c not in cns[g]:
                cm += 1
            cns[g].get(c, lambda: True)
        s += cm * prof.cn_load_s
        for j, lo in enumerate(r.loras):
            if lo in los[g]:
                s += prof.diff_lora_hit_s
            else:
                lm += 1
                s += prof.diff_lora_first_s + j * prof.diff_lora_growth_s
                s += prof.remote_fetch_s if lora_source == "remote" else 0.0
            los[g].get(lo, lambda: True)
        mx_c, mx_l = max(mx_c, len(cns[g])), max(mx_l, len(los[g]))
        free[g] = start + s
        prev = start
        out.append(Done(r.t, start, start + s, len(r.controlnets), len(r.loras), start, cm, lm))
    return DiffusionSimResult(out, mx_c, cn_cache, lora_cache, mx_l, len(reqs))


@dataclass
class _Server:
    slots: list  # free_at per slot
    holds: list  # the ControlNet id a slot's running branch uses (None = none)
    cache: LRUCache
    ready: dict = field(default_factory=dict)  # ControlNet id -> loaded at


def simulate_katz(reqs, prof: SimProfile, base_replicas: int, cn_servers: int, k: int = 20, cn_cache: int = 16,
                  lora_cache: int = 4, lora_source: str = "remote", slots: Optional[int] = None,
                  drop_loras: bool = False) -> DiffusionSimResult:
    """Katz; ``drop_loras`` is NoLoRA (the quality floor): the same pipeline with every request's
    LoRAs dropped, so no fetch, load or patch."""
    if base_replicas < 1:
        raise ConfigError(f"system.base_replicas must be >= 1, got {base_replicas}")
    if k < 0:
        raise ConfigError(f"system.k (patch step bound K) must be >= 0, got {k}")
    needs_cn = any(r.controlnets for r in reqs)
    if needs_cn and cn_servers < 1:
        raise ConfigError("system.cn_servers: the trace has ControlNet requests but the pool has 0 servers")
    if slots is None:
        slots = max(1, math.floor(prof.katz_step_s / prof.cn_branch_step_s + 1e-9))
    if cn_cache < slots:
        raise ConfigError(f"system.cn_cache must be >= the {slots} branch slots per server, got {cn_cache}")
    servers = [_Server([0.0] * slots, [None] * slots, LRUCache(cn_cache, "system.cn_cache")) for _ in range(cn_servers)]
    free = [0.0] * base_replicas
    los = [LRUCache(lora_cache, "system.lora_cache") for _ in range(base_replicas)]
    out, prev, mx_c, mx_l = [], 0.0, 0, 0
    for r in reqs:
        g = min(range(base_replicas), key=lambda i: free[i])
        start = max(r.t, free[g])
        n_cn = len(r.controlnets)
        if drop_loras:
            r = type(r)(r.t, r.service, r.base_model, r.controlnets, ())
        # remote fetch only for misses in the replica's host cache; loaders run in parallel
        misses = [lo for lo in r.loras if lo not in los[g]]
        for lo in r.loras:
            los[g].get(lo, lambda: True)
        mx_l = max(mx_l, len(los[g]))
        # the loaders read each file from where it is: the host cache, or the remote store
        load_s = prof.remote_fetch_s if misses and lora_source == "remote" else prof.local_lora_load_s
        dur = prof.katz_latency(n_cn, len(r.loras), k, load_s)
        cn_ready, cm = start, 0
        if n_cn:
            start, cn_ready, cm = _place_controlnets(servers, r.controlnets, start, dur, prof)
            mx_c = max(mx_c, max(len(s.cache) for s in servers))
        end = start + dur
        free[g] = end
        prev = start
        out.append(Done(r.t, start, end, n_cn, len(r.loras), cn_ready, cm, len(misses)))
    return DiffusionSimResult(out, mx_c, cn_cache, lora_cache, mx_l, len(reqs))


def _place_controlnets(servers, cn_ids, t: float, dur: float, prof: SimProfile):
    """Two branch slots per ControlNet at the earliest time >= t; returns (start, ready, misses)."""
    while True:
        plan, ok = [], True
        taken = set()
        loads = []
        for c in cn_ids:
            for _branch in range(2):
                best = None
                for si, s in enumerate(servers):
                    in_use = {s.holds[j] for j in range(len(s.slots)) if s.slots[j] > t and s.holds[j] is not None}
                    in_use |= {cc for (ss, _j, cc) in plan if ss == si}
                    for j, f in enumerate(s.slots):
                        if f > t or (si, j) in taken:
                            continue
                        hit = c in s.cache
                        if not hit and len(s.cache) >= s.cache.capacity and \
                                all(key in in_use for key in s.cache.items) and c not in in_use:
                            continue  # every cached ControlNet is in use: nothing to evict here
                        ready = s.ready.get(c, 0.0) if hit else t + prof.cn_load_s
                        cand = (ready, not hit, si, j)
                        if best is None or cand < best:
                            best = cand
                if best is None:
                    ok = False
                    break
                ready, miss, si, j = best
                taken.add((si, j))
                plan.append((si, j, c))
                loads.append((si, c, miss, ready))
            if not ok:
                break
        if ok:
            break
        # wait for the next slot to free up
        nxt = min((f for s in servers for f in s.slots if f > t), default=None)
        if nxt is None:
            raise ConfigError("system.cn_servers: a request needs more ControlNet slots than the pool has "
                              f"({2 * len(cn_ids)} branch slots)")
        t = nxt
    ready_all, misses = t, 0
    for si, c, miss, ready in loads:
        s = servers[si]
        if miss and c not in s.cache:
            in_use = {s.holds[j] for j in range(len(s.slots)) if s.slots[j] > t}
            in_use |= {cc for (ss, _j, cc) in plan if ss == si}
            _insert_lru(s.cache, c, in_use)
            s.ready[c] = ready
            misses += 1
        else:
            s.cache.get(c, lambda: True)
        ready_all = max(ready_all, s.ready.get(c, ready))
    start = ready_all  # the request waits for its ControlNets' loads
    for si, j, c in plan:
        servers[si].slots[j] = start + dur
        servers[si].holds[j] = c
    return start, ready_all, misses


def _insert_lru(cache: LRUCache, key, in_use) -> None:
    """Insert evicting the least recently used entry that is not in use."""
    if len(cache.items) >= cache.capacity:
        for old in list(cache.items):
            if old not in in_use:
                del cache.items[old]
                cache.evictions += 1
                break
    cache.misses += 1
    cache.items[key] = True
    assert len(cache.items) <= cache.capacity


def scale_arrivals(reqs, rate_rps: float, base_rate: float):
    from impl.common.traces.addons import AddonRequest

    f = base_rate / rate_rps
    return [AddonRequest(r.t * f, r.service, r.base_model, r.controlnets, r.loras) for r in reqs]


def max_rate_at_slo(run, reqs, base_rate: float, slo_s: float, lo: float = 0.01, hi: float = 20.0,
                    iters: int = 18) -> tuple[float, DiffusionSimResult]:
    """The largest arrival rate whose p99 latency meets ``slo_s`` (bisection; p99 rises with rate)."""
    best = None
    if run(scale_arrivals(reqs, lo, base_rate)).p99() > slo_s:
        return 0.0, run(scale_arrivals(reqs, lo, base_rate))
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        res = run(scale_arrivals(reqs, mid, base_rate))
        if res.p99() <= slo_s:
            lo, best = mid, res
        else:
            hi = mid
    return lo, best if best is not None else run(scale_arrivals(reqs, lo, base_rate))
