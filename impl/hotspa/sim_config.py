"""Knobs only sim mode reads (``system.sim.*``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class HotSPaSimKnobs:
    # ZeRO-1 optimizer sharding in every strategy (on in every config of the authors' scripts).
    zero1: bool = True
    # Memory: the step model's (activations by module x the profile's activation_factor, its
    # logits and overhead; impl.common.cost.varlen_model.MemoryModel) under memory - this headroom;
    # 4 GiB [R] (CUDA context, NCCL and allocator slack of the authors' Hetu runs); null = the
    # step model's allocatable bytes (Megatron-LM's headroom fitted on H100: 12.6 GiB, which
    # refuses four of the authors' A800 strategies by 1.5-6%; README sensitivity).
    memory_headroom_bytes: Optional[float] = 4294967296.0
    # Megatron sequence parallelism: on, every activation is split by tp; off (TP without
    # --sequence-parallel), norms, residuals and layer inputs stay whole per TP rank [R: the paper does not say]
    sequence_parallel: bool = True
    # Static baselines' grid search: the largest TP (or Ulysses SP) degree; 8 = intra-node only
    # (as our planner). 16 admits the authors' cross-node 32B preset (1,16,2).
    static_max_tp: int = 8
    # Static baselines: skip the grid search and run this [dp, tp, pp] (e.g. [1, 16, 2], the
    # paper's 32B home strategy) - the sensitivity input of the headline (README).
    static_strategy: List[int] = field(default_factory=list)
    # Also run the job at these contexts (lengths re-clipped to each), reported as
    # ``<metric>@ctx<C>``; the headline metrics stay those of workload.context.
    contexts: List[int] = field(default_factory=list)
    # Also price every switch of the step under these planner policies (same batches),
    # reported as ``switch_time_s@<policy>``; the step uses system.switch_policy.
    report_policies: List[str] = field(default_factory=list)
    # Ablations (ours): keep a bf16 parameter replica per strategy (no parameter switches;
    # the updated home params are copied to each replica after the step), and one fused
    # buffer per peer pair (off: one message, one latency, per slice).
    replicas: bool = False
    buffer_fusion: bool = True
    # Planner (grouping=planned, ours; impl/hotspa/README.md "Reconstructed choices"): candidate boundaries, most groups, and how many
    # steps of lengths (from a stream seeded seed+1) form the histogram it plans on.
    plan_candidates: List[int] = field(default_factory=lambda: [2048, 4096, 8192, 16384, 32768])
    plan_max_groups: int = 4
    plan_sample_steps: int = 2
