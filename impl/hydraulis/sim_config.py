"""Knobs only sim mode reads (``system.sim.*``)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List


class CostSource(enum.StrEnum):
    """derived = the Megatron step model for every strategy; published = the authors' 7B table."""

    derived = "derived"
    published = "published"


@dataclass
class SimCost:
    """Where strategy prices come from (impl/hydraulis/cost/strategy.py): derived = the Megatron step model
    (``impl.common.cost.varlen_model.seq_cost``) for every strategy, the one pricing path;
    published = the authors' 7B coefficient table (opt-in sensitivity input; 7B only)."""

    source: CostSource = CostSource.derived


@dataclass
class HydraulisSimKnobs:
    cost: SimCost = field(default_factory=SimCost)
    # Deterministic ILPs in sim (harness contract: same config, same metrics): a HiGHS node
    # limit, with a generous wall-clock backstop that a sim run should never reach.
    ilp_node_limit: int = 50
    ilp_time_limit_s: float = 60.0
    # Steps of lengths (a stream seeded seed+1) whose histogram feeds the generator and the
    # baselines' grid searches.
    sample_steps: int = 4
    # Megatron-like grid search: the largest TP degree (16 spans two nodes: the only way a
    # 32B model holds 32K tokens without CP).
    megatron_max_tp: int = 16
    # DeepSpeed-like: ZeRO stages tried (1 = optimizer sharded; 3 = parameters too, gathered
    # per micro-batch, overlapped with compute).
    deepspeed_zero_stages: List[int] = field(default_factory=lambda: [1, 3])
    # HotSPa-like: length-bucket boundaries (descending, tokens); [] = halving from the context
    # down to 2048.
    hotspa_boundaries: List[int] = field(default_factory=list)
