"""CaraServe's policy and its baselines' as registered serving policies (the behaviour each name
stands for: :class:`impl.common.llm.scheduler.ServingPolicy`).

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
"""
from __future__ import annotations

from dataclasses import dataclass

from impl.common.llm.scheduler import PRELOADED, ServingPolicy, dominant_adapter, serving_adapter
from impl.common.registry import Registry


@dataclass(frozen=True)
class CaraServePolicy:
    serving: ServingPolicy
    # adapters of ranks outside Punica's BGMV set are refused (or padded up to one)
    punica_ranks: bool = False
    # no real-mode engine (the merged HF-PEFT baseline is the sim's SLO reference only)
    sim_only: bool = False


POLICIES: Registry[CaraServePolicy] = Registry("policy")
POLICIES.add("cached", CaraServePolicy(PRELOADED))
POLICIES.add("ondmd", CaraServePolicy(ServingPolicy(sync_load=True)))
POLICIES.add("caraserve", CaraServePolicy(ServingPolicy(async_load=True, cpu_assisted_prefill=True,
                                                        decode_waits_for_load=True)))
POLICIES.add("slora", CaraServePolicy(ServingPolicy(kernels=("mbgmv", "mbgmv"), sync_load=True,
                                                    prefetch_next_batch=True, loads_ab_twice=True)))
POLICIES.add("punica", CaraServePolicy(ServingPolicy(kernels=("sgmv", "bgmv_punica"), sync_load=True),
                                       punica_ranks=True))
POLICIES.add("dlora", CaraServePolicy(ServingPolicy(sync_load=True, merged_adapter=dominant_adapter, migrates=True)))
# its kernels are never used: every iteration runs on merged weights
POLICIES.add("hf_peft", CaraServePolicy(ServingPolicy(sync_load=True, merged_adapter=serving_adapter,
                                                      lora_compute=False), sim_only=True))


def serving(name: str) -> ServingPolicy:
    return POLICIES.get(name).serving
