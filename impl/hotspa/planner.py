"""Strategy and group planning from a length histogram ([R], ours: the authors'
presets were hand-tuned offline; impl/hotspa/README.md "Reconstructed choices"): enumerate (dp,tp,pp)
with tp <= ``max_tp`` (and, for a group none of them holds, TP across nodes, as the paper's 32B
(1,16,2) holds 32K), keep those whose ``maxlen`` covers a group's bound, give each group the strategy with the lowest estimated group time, and pick the
boundary set (from ``candidates``, at most ``max_groups`` groups) that minimises the whole
priced step: Σ group times + Σ switch times (+ the DP reductions and the update)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from impl.common.api import ConfigError
from impl.common.baselines.hotspa_like import BucketSearch
from impl.common.varlen.packing import assign_dp, hotspa_pack

from impl.hotspa.cost import PricingEnv, enumerate_strategies, pipeline_time_s, price_grouped_step
from impl.hotspa.strategy import GroupPlan, Strategy


@dataclass(frozen=True)
class PlannedGroups:
    plan: GroupPlan
    est_step_s: float
    candidates_tried: int


def plan_groups(env: PricingEnv, batches, context: int, *, candidates, max_groups: int, max_tp: int, pad: str,
                align: int, policy: str) -> PlannedGroups:
    strategies = enumerate_strategies(env.N, env.gpn, env.model.num_layers, env.model.heads, max_tp)
    if not strategies:
        raise ConfigError(f"system.grouping=planned: no (dp,tp,pp) of {env.N} GPUs with tp <= {max_tp}")
    # TP across nodes (tp a multiple of the node) is a candidate only for a group that no
    # strategy of tp <= max_tp holds: the HotSPa paper's 32B home strategy (1,16,2) spans two
    # nodes so that its longest group holds 32K tokens (impl/hotspa/README.md "Reconstructed choices").
    wide = [s for s in enumerate_strategies(env.N, env.gpn, env.model.num_layers, env.model.heads, env.N)
            if s.tp > max_tp]
    maxlens = {s: env.maxlen(s) for s in strategies + wide}
    best_len = max(maxlens.values())
    if best_len < context:
        s = max(maxlens, key=lambda x: (maxlens[x], x))
        raise ConfigError(f"workload.context: a sequence of {context} tokens is longer than every strategy's maxlen "
                          f"(the largest {best_len} at {s}, tp up to {max(x.tp for x in maxlens)})")
    inner = sorted({int(c) for c in candidates if 0 < int(c) < context}, reverse=True)
    # Per (lo, hi) range: the fastest feasible strategy over the sample, priced alone.
    lengths_by_step = [(b.ids, b.lengths) for b in batches]

    def choose(lo: int, hi: int) -> Strategy:
        feas = [s for s in strategies if maxlens[s] >= hi] or [s for s in wide if maxlens[s] >= hi]
        scores = {}
        for s in feas:
            t = 0.0
            for ids, lens in lengths_by_step:
                sel = (lens > lo) & (lens <= hi)
                if sel.any():
                    mbs = hotspa_pack(ids[sel], lens[sel], bound=hi, pad=pad, align=align, field="planner")
                    t += pipeline_time_s(env.cost(s), assign_dp(mbs, s.dp), s.pp)
            scores[s] = t
        return min(feas, key=lambda s: (scores[s], s))

    def mean_step(b: list, strat: list) -> float:
        gp = GroupPlan(tuple(b), tuple(strat))
        return math.fsum(price_grouped_step(env, ids, lens, gp, pad=pad, align=align, policy=policy).step_s
                         for ids, lens in lengths_by_step) / len(lengths_by_step)

    # fewest cuts first; a later boundary set wins only when faster by more than float noise
    search = BucketSearch(max_groups=max_groups, order="size", tolerance_s=1e-12)
    est, b, strat, tried = search.search(context, inner, choose, mean_step)
    return PlannedGroups(GroupPlan(tuple(b), tuple(strat)), est, tried)
