"""CaraServe and its baselines as harness systems (one class, variants chosen by knobs).

| system       | policy    | router      | notes                                              |
|--------------|-----------|-------------|----------------------------------------------------|
| caraserve    | caraserve | rank_aware  | CPU-assisted prefill while the adapter loads       |
| cached       | cached    | mostidle    | all adapters resident (upper bound)                |
| ondmd        | ondmd     | mostidle    | synchronous load, stalls the iteration             |
| slora        | slora     | mostidle    | prefetch at arrival, MBGMV, sync remainder         |
| punica       | punica    | punica      | BGMV ranks 16/32/64, largest batch with room       |
| dlora        | dlora     | mostidle    | merged mode when one adapter dominates             |
| mostidle     | caraserve | mostidle    | routing baselines (servers run CaraServe)          |
| route_random | caraserve | random      |                                                    |
| firstfit     | caraserve | firstfit    |                                                    |
| hf_peft      | hf_peft   | mostidle    | merged single adapter, no cross-adapter batching   |
|              |           |             | (sim only; the reference of the paper's S3 SLO)    |

Real mode runs the serving engine on a tiny Llama (one server); sim mode runs the request-level
simulator at paper scale (one or many servers) with costs from the hardware profile.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import pathlib
import tempfile
from dataclasses import dataclass, field
from typing import List

import numpy as np

from impl.common.api import ConfigError, JobContext, Metric, RunResult, System
from impl.common.llm.kernels import PUNICA_RANKS
from impl.common.llm.metrics import check_conservation, serving_metrics
from impl.common.llm.scheduler import SchedulerConfig, SReq
from impl.common.llm.model import check_llama_shape
from impl.common.servesim.cost import ServingCost, ServingCostConfig
from impl.common.traces import Trace, TraceSpec, generate_trace, load_trace

from .policies import POLICIES
from .router import ROUTERS

EVICTIONS = ("auto", "lru", "on_finish")
SLO_REFERENCES = ("base", "isolated", "hf_peft")
ADAPTER_SOURCES = ("peft", "random")


class ServingSystem(System):
    @dataclass
    class Config:
        policy: str = "caraserve"
        router: str = "rank_aware"
        max_batch: int = 64
        max_prefill_tokens: int = 4096
        # Device adapter pool (slots). Real: tiny adapters; sim: paper-scale A10 budget [R].
        pool_slots: int = 8
        # Sim: slots per server at paper scale [R]: 64 adapters of mean rank 30 on 7B ~ 3.8 GiB of
        # an A10's 24 GiB next to 13.5 GB of weights and the KV cache.
        sim_pool_slots: int = 64
        # Layer groups the loader moves in order (CaraServe switches at a group boundary).
        load_groups: int = 4
        # 0: CPU LoRA path in-process; 1: one worker process over shared memory.
        cpu_workers: int = 1
        # Real mode: other policies run in the same job on the same trace, rotating order per
        # round (a gate compares medians measured side by side).
        interleave: List[str] = field(default_factory=list)
        # Sim cost model knobs [R], units and sources in impl/common/servesim/cost.py
        # (+system.cost.bgmv_efficiency=...).
        cost: ServingCostConfig = field(default_factory=ServingCostConfig)
        # Rank-aware router: fitted model must reach this R^2; SLO violation penalty (s).
        min_r2: float = 0.9
        penalty_s: float = 1.0
        dlora_merge_share: float = 0.6
        dlora_merge_min: int = 4
        # dLoRA co-migration (sim, >1 server): every interval the most loaded server (queued +
        # running + incoming requests) sheds work to the least loaded when they differ by more
        # than the threshold (README "dLoRA").
        dlora_migrate: bool = True
        dlora_migrate_interval_s: float = 0.5
        dlora_migrate_threshold: int = 4
        plots: bool = True
        # Punica: round each adapter's rank up to {16, 32, 64} instead of rejecting the trace.
        pad_ranks_to_supported: bool = False
        # Adapter pool eviction: "lru" (a slot is reused only when needed), "on_finish" (S-LoRA's
        # public code: when a request finishes, every adapter no remaining request uses is
        # evicted), "auto" = on_finish for the policies in evict_on_finish_policies, else lru.
        # CACHED never evicts.
        adapter_eviction: str = "auto"
        evict_on_finish_policies: List[str] = field(default_factory=lambda: ["slora"])
        # LoRA kernels: "auto" = the policy's own (impl/caraserve/policies.py),
        # "punica" = SGMV prefill + BGMV decode (pads to the batch's max rank), "slora" = MBGMM /
        # MBGMV (no padding, ~ sum r). The paper's S3 (v1) runs its router on both.
        lora_kernels: str = "auto"
        # Real mode: where the adapters come from. "peft": created, saved and re-loaded
        # with PEFT; "random": drawn directly in PEFT's layout and init, on the job's device
        # (a 7B-shaped base: PEFT's copy-save-load round trip would take minutes and 2x the model).
        adapter_source: str = "peft"

        def __post_init__(self):
            names = POLICIES.names()
            if self.policy not in POLICIES:
                raise ConfigError(f"system.policy: unknown policy {self.policy!r} (one of: {', '.join(names)})")
            if self.router not in ROUTERS:
                raise ConfigError(f"system.router: unknown router {self.router!r} (one of: {', '.join(ROUTERS.names())})")
            for p in list(self.interleave) + list(self.evict_on_finish_policies):
                if p not in POLICIES:
                    raise ConfigError(f"system.interleave / system.evict_on_finish_policies: unknown policy {p!r} "
                                      f"(one of: {', '.join(names)})")
            if self.max_batch < 1 or self.pool_slots < 1 or self.load_groups < 1:
                raise ConfigError("system.max_batch, system.pool_slots and system.load_groups must be >= 1 "
                                  f"(got {self.max_batch}, {self.pool_slots}, {self.load_groups})")
            if self.adapter_source not in ADAPTER_SOURCES:
                raise ConfigError(f"system.adapter_source: unknown {self.adapter_source!r} "
                                  f"(one of: {', '.join(ADAPTER_SOURCES)})")
            if self.adapter_eviction not in EVICTIONS:
                raise ConfigError(f"system.adapter_eviction: unknown {self.adapter_eviction!r} "
                                  f"(one of: {', '.join(EVICTIONS)})")
            scheduler_config(self)  # its own checks, at load rather than mid-run
            if self.cpu_workers not in (0, 1):
                # One worker process serves every CPU-path request; more are not implemented, and a
                # larger value must not be silently treated as 1.
                raise ConfigError(f"system.cpu_workers must be 0 (in-process CPU path) or 1 (a worker process), "
                                  f"got {self.cpu_workers}")

    # ---- shared --------------------------------------------------------------------------
    def trace(self, job: JobContext) -> Trace:
        wl = job.workload
        t, a = wl.trace, wl.adapters
        if t.file:
            table = None
            if a.num_adapters:
                rng = np.random.default_rng(job.seed)
                from impl.common.traces import rank_mix
                ranks = rank_mix(a.num_adapters, a.ranks, a.rank_weights, rng)
                table = {f"lora-{i:05d}": r for i, r in enumerate(ranks)}
            trace = load_trace(t.file, table)
        else:
            spec = TraceSpec(num_requests=t.num_requests, arrival=t.arrival, rate_rps=t.rate_rps, cv=t.cv,
                             num_adapters=a.num_adapters, zipf_alpha=a.zipf_alpha, ranks=list(a.ranks),
                             rank_weights=list(a.rank_weights), prompt_median=t.prompt_median,
                             output_median=t.output_median, sigma=t.sigma, len_min=t.len_min, len_max=t.len_max,
                             output_min=t.output_min, output_max=t.output_max, per_request=a.per_request,
                             popularity=a.popularity, lognormal_sigma=a.lognormal_sigma,
                             popularity_groups=self.popularity_groups(wl))
            trace = generate_trace(spec, job.seed)
        if POLICIES.get(self.cfg.policy).punica_ranks:
            if self.cfg.pad_ranks_to_supported:
                for a, r in trace.adapters.items():
                    if r > max(PUNICA_RANKS):
                        raise ConfigError(f"adapter {a!r}: rank {r} exceeds the Punica BGMV maximum {max(PUNICA_RANKS)}")
                    trace.adapters[a] = min(x for x in PUNICA_RANKS if x >= r)
            return trace.validate(PUNICA_RANKS, "Punica BGMV")
        return trace.validate()

    @staticmethod
    def popularity_groups(wl) -> int:
        """workload.adapters.popularity_groups, 0 = one group per server (the papers' MAF mapping)."""
        g = wl.adapters.popularity_groups
        return wl.num_servers if g == 0 else g

    def popularity_info(self, wl) -> dict:
        """What the record says of the adapter popularity (README "MAF stand-in": named wherever it is used)."""
        a = wl.adapters
        if wl.trace.file:
            return {"kind": "file", "file": str(wl.trace.file)}
        if a.per_request:
            return {"kind": "per_request"}
        if a.popularity == "lognormal":
            return {"kind": "lognormal", "stand_in_for": "MAF (Azure Functions 2019), impl/caraserve/README.md [R]",
                    "sigma": a.lognormal_sigma, "groups": self.popularity_groups(wl)}
        return {"kind": "zipf", "alpha": a.zipf_alpha}

    def check(self, mode, workload, hardware, fault) -> None:
        kind = getattr(workload, "kind", None)
        if kind != "serving":
            raise ConfigError(f"workload.kind: {self.name} needs a 'serving' workload, got {kind!r}")
        a = workload.adapters
        if not a.per_request and not workload.trace.file:
            from impl.common.traces import check_popularity

            if a.popularity_groups < 0:
                raise ConfigError(f"workload.adapters.popularity_groups must be >= 0 (0 = one group per server), "
                                  f"got {a.popularity_groups}")
            check_popularity(a.popularity, a.zipf_alpha, a.lognormal_sigma, self.popularity_groups(workload),
                             a.num_adapters)
        if getattr(workload, "slo_reference", "isolated") not in SLO_REFERENCES:
            raise ConfigError(f"workload.slo_reference: unknown {workload.slo_reference!r} "
                              f"(one of: {', '.join(SLO_REFERENCES)})")
        if mode == "sim":
            if workload.slo_reference_requests < 1:
                raise ConfigError(f"workload.slo_reference_requests must be >= 1, got {workload.slo_reference_requests}")
            if hardware.host_link_bw_bytes_per_s <= 0 or hardware.memory_bw_bytes_per_s <= 0:
                raise ConfigError(f"hardware.{hardware.name}: host_link_bw_bytes_per_s and memory_bw_bytes_per_s must "
                                  f"be > 0 for serving sim (got {hardware.host_link_bw_bytes_per_s}, "
                                  f"{hardware.memory_bw_bytes_per_s})")
            ServingCost.from_profile(workload.paper_model, hardware, self.cfg.cost, tp=workload.tp)  # its checks
        else:
            for p in [self.cfg.policy, *self.cfg.interleave]:
                if POLICIES.get(p).sim_only:
                    raise ConfigError(f"system.policy: {p} is sim only (mode=sim)")
            check_llama_shape(workload.model)

    def run(self, job: JobContext) -> RunResult:
        if job.mode == "sim":
            from impl.caraserve.sim import run_sim

            return run_sim(self, job)
        from impl.caraserve.real import run_real

        return run_real(self, job)

    def sched_config(self, policy: str | None = None, sim: bool = False) -> SchedulerConfig:
        return scheduler_config(self.cfg, policy, sim)

    def evict_on_finish(self, policy: str) -> bool:
        return evict_on_finish(self.cfg, policy)


def scheduler_config(c: ServingSystem.Config, policy: str | None = None, sim: bool = False) -> SchedulerConfig:
    """The scheduler of ``policy`` (default: the system's) with the system's knobs."""
    name = policy or c.policy
    return SchedulerConfig(policy=POLICIES.get(name).serving, max_batch=c.max_batch,
                           max_prefill_tokens=c.max_prefill_tokens,
                           pool_slots=c.sim_pool_slots if sim else c.pool_slots, load_groups=c.load_groups,
                           dlora_merge_share=c.dlora_merge_share, dlora_merge_min=c.dlora_merge_min,
                           dlora_migrate=c.dlora_migrate, dlora_migrate_interval_s=c.dlora_migrate_interval_s,
                           dlora_migrate_threshold=c.dlora_migrate_threshold,
                           evict_on_finish=evict_on_finish(c, name), lora_kernels=c.lora_kernels)


def evict_on_finish(c: ServingSystem.Config, policy: str) -> bool:
    if POLICIES.get(policy).serving.preload_all:
        return False
    e = c.adapter_eviction
    return policy in c.evict_on_finish_policies if e == "auto" else e == "on_finish"
