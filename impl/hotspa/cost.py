"""Pricing one training step of HotSPa (or of a static baseline) over the analytic cost model
(packing and schedule as in the authors' code, `examples/hotspa`; the switch model and the
static baselines are ours, impl/hotspa/README.md "Reconstructed choices"): the environment that caches per-strategy costs, memory limits,
placements and switch plans, and the step pricers both the simulator and the planner call."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

from impl.common.api import ConfigError
from impl.common.baselines.static import StaticGridConfig, fastest, mean_step_s
from impl.common.cost.seqlen import SeqCost
from impl.common.cost.transformer import layer_params
from impl.common.cost.varlen_model import StrategyLayout, MemoryModel, seq_cost
from impl.common.megatron.step import optimizer_step_s
from impl.common.parallel.migration import Transfer, migration_time_s, plan_migration
from impl.common.parallel.plan import Plan, uniform_plan
from impl.common.varlen.packing import MicroBatch, assign_dp, greedy_pack, group_by_boundaries, hotspa_pack

from impl.hotspa.strategy import GroupPlan, Strategy
from impl.common import collectives as coll
from impl.common.cost.comm import flow_rates, link_efficiencies

PARAM_BYTES = 2.0  # bf16 compute copy: what a parameter switch moves
GRAD_BYTES = 4.0  # fp32 accumulated gradient: what a gradient switch moves


class PricingEnv:
    """Model, hardware and GPUs of one job, with per-strategy caches."""

    def __init__(self, wl, hw, knobs) -> None:
        self.model = wl.model
        self.N = wl.num_gpus
        self.gpn = wl.gpus_per_node
        self.hw = dataclasses.replace(hw, gpus_per_node=wl.gpus_per_node)
        self.mem = MemoryModel.for_hardware(self.hw, zero1=knobs.zero1, sequence_parallel=knobs.sequence_parallel,
                                            headroom_bytes=knobs.memory_headroom_bytes)
        # time and memory read the same sequence-parallel setting
        self.sequence_parallel = bool(knobs.sequence_parallel)
        self._cost: dict = {}
        self._plans: dict = {}
        self._transfers: dict = {}

    # ---- per strategy ---------------------------------------------------------------
    def layout(self, s: Strategy, parallel: str = "tp") -> StrategyLayout:
        return StrategyLayout(s.dp, s.tp, s.pp, parallel)

    def cost(self, s: Strategy, parallel: str = "tp") -> SeqCost:
        key = (s, parallel)
        if key not in self._cost:
            self._cost[key] = seq_cost(self.model, self.layout(s, parallel), self.hw,
                                       sequence_parallel=self.sequence_parallel)
        return self._cost[key]

    def maxlen(self, s: Strategy, parallel: str = "tp") -> int:
        return self.mem.maxlen(self.model, self.layout(s, parallel), self.N)

    def memory_bytes(self, s: Strategy, seq_len: int, parallel: str = "tp") -> float:
        return self.mem.bytes_at(self.model, self.layout(s, parallel), self.N, seq_len)

    def switch_peak_bytes(self, a: Strategy, b: Strategy) -> float:
        return self.mem.switch_peak_bytes(self.model, self.layout(a), self.layout(b), self.N)

    def replica_bytes(self, strategies: Sequence[Strategy], running: Strategy) -> float:
        """The "two replicas" ablation's extra memory while ``running`` computes: the bf16
        parameter copies of every other strategy stay resident."""
        return sum(self.mem.state_bytes(self.model, self.layout(s), self.N)["params_bytes"]
                   for s in set(strategies) - {running})

    def plan(self, s: Strategy) -> Plan:
        if s not in self._plans:
            self._plans[s] = uniform_plan(self.N, self.gpn, s.dp, s.tp, s.pp, self.model.num_layers, s.dp * s.pp,
                                          label=str(s), cross_node_tp=True)
        return self._plans[s]

    def unit_params(self, unit: int) -> float:
        L, h, v = self.model.num_layers, self.model.hidden, self.model.vocab
        if unit == -1:
            return float(v * h)  # token embedding
        if unit == L:
            return float(v * h + h)  # LM head + final norm
        return float(layer_params(self.model))

    def transfers(self, src: Strategy, dst: Strategy, policy: str) -> list[Transfer]:
        """The switch plan src -> dst at 1 byte per parameter (scaled by the caller); cached,
        as HotSPa caches each (from, to) plan after its first occurrence."""
        key = (src, dst, policy)
        if key not in self._transfers:
            self._transfers[key] = plan_migration(self.plan(src), self.plan(dst), self.unit_params, policy)[0]
        return self._transfers[key]

    def switch_s(self, src: Strategy, dst: Strategy, bytes_per_param: float, policy: str, fused: bool) -> float:
        """Our switch model (impl/hotspa/README.md, "Reconstructed choices"): the busiest GPU's intra-node bytes / NVLink bw + inter-node
        bytes / IB bw (:func:`migration_time_s`), plus one latency per batched send group
        (fused: one buffer per peer pair) or per slice (unfused) at the busiest endpoint."""
        if src == dst:
            return 0.0
        trs = [dataclasses.replace(t, nbytes=t.nbytes * bytes_per_param) for t in self.transfers(src, dst, policy)]
        if not trs:
            return 0.0
        intra_bw, inter_bw, intra_lat, inter_lat = flow_rates(self.hw)  # each flow: NVLink, or one NIC
        t = migration_time_s(trs, intra_bw, inter_bw)
        lat = inter_lat if any(x.inter_node for x in trs) else intra_lat
        if fused:
            return t + lat
        msgs: dict[tuple[str, int], int] = {}
        for x in trs:
            for k in (("s", x.src), ("r", x.dst)):
                msgs[k] = msgs.get(k, 0) + 1
        return t + lat * max(msgs.values())

    def dp_collective_s(self, s: Strategy, bytes_per_param: float, kind: str, parallel: str = "tp") -> float:
        """Reduce-scatter, all-gather or all-reduce (``rs``/``ag``/``ar``) of the GPU's model shard over
        the data-parallel group (Ulysses: dp x sp), priced by :mod:`impl.common.collectives`."""
        lay = self.layout(s, parallel)
        n = s.dp * (s.tp if parallel == "ulysses" else 1)
        if n <= 1:
            return 0.0
        nbytes = bytes_per_param * self.model_params / lay.param_shard
        # Megatron layout: a stage's DP ranks are tp apart (Ulysses: dp x sp consecutive GPUs)
        stride = 1 if parallel == "ulysses" else s.tp
        op = {"rs": coll.CollOp.REDUCE_SCATTER, "ag": coll.CollOp.ALL_GATHER, "ar": coll.CollOp.ALL_REDUCE}[kind]
        hw = self.hw if self.hw.gpus_per_node == self.gpn else dataclasses.replace(self.hw, gpus_per_node=self.gpn)
        k = coll.group_ranks_per_node(n, stride, self.gpn)
        return coll.time_s(op, nbytes, hw, n, k, **link_efficiencies(self.hw))

    @property
    def model_params(self) -> float:
        from impl.common.cost.transformer import model_params

        return float(model_params(self.model))

    def optimizer_s(self) -> float:
        """Adam on this GPU's ZeRO-1 shard (|θ|/N parameters), memory-bound, x the step model's
        memory-bound factor, plus its per-iteration overhead (as the step model prices them)."""
        return optimizer_step_s(self.model_params, self.N, self.hw)


def mb_time_s(cost: SeqCost, mb: MicroBatch) -> float:
    """A packed row: attention per segment, the linear terms over the padded row."""
    if mb.is_empty:
        return 0.0
    return cost.a * sum(x * x for x in mb.lengths) + cost.b * mb.padded_len + cost.c


def pipeline_time_s(cost: SeqCost, ranks: Sequence[Sequence[MicroBatch]], pp: int) -> float:
    """1F1B: Σ_mb T + (pp-1)·max T per DP rank (empty placeholders cost nothing); the slowest
    rank gates."""
    worst = 0.0
    for rank in ranks:
        ts = [mb_time_s(cost, mb) for mb in rank if not mb.is_empty]
        if ts:
            worst = max(worst, math.fsum(ts) + (pp - 1) * max(ts))
    return worst


@dataclass
class GroupedStepPrice:
    compute_s: float = 0.0
    switch_s: float = 0.0
    dp_sync_s: float = 0.0  # gradient reductions over DP (and ZeRO-1 parameter all-gather)
    optimizer_s: float = 0.0
    tokens: int = 0
    group_compute_s: list = field(default_factory=list)  # per group, longest first (0 when empty)
    group_micro_batches: list = field(default_factory=list)
    order: list = field(default_factory=list)  # strategies in the order they ran
    switch_by_policy: dict = field(default_factory=dict)
    peak_memory_bytes: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.switch_s + self.dp_sync_s + self.optimizer_s


def _schedule(gp: GroupPlan, nonempty: Sequence[bool]) -> list[Strategy]:
    """The authors' iteration schedule (`examples/hotspa`): home, then the non-empty groups from shortest to longest, home last (the
    longest group runs there and the optimizer steps there, even when that group is empty)."""
    rest = [gp.strategies[g] for g in range(len(gp.strategies) - 1, 0, -1) if nonempty[g]]
    return [gp.home] + rest + [gp.home]


def switches_s(env: PricingEnv, layouts: Sequence[Strategy], policy: str, fused: bool, replicas: bool) -> float:
    """Parameter (2 B) and gradient (4 B) switches along ``layouts`` (home first and last)."""
    total = 0.0
    for i, (x, y) in enumerate(zip(layouts, layouts[1:])):
        if x == y:
            continue
        if not replicas:
            total += env.switch_s(x, y, PARAM_BYTES, policy, fused)
        if i > 0:  # the first layout (home at step start) has no gradients yet
            total += env.switch_s(x, y, GRAD_BYTES, policy, fused)
    if replicas:  # after the update, refresh each replica from home once
        for s in sorted(set(layouts[1:-1]) - {layouts[0]}):
            total += env.switch_s(layouts[0], s, PARAM_BYTES, policy, fused)
    return total


def price_grouped_step(env: PricingEnv, ids, lengths, gp: GroupPlan, *, pad: str, align: int, policy: str,
                       fused: bool = True, replicas: bool = False,
                       report_policies: Sequence[str] = ()) -> GroupedStepPrice:
    """HotSPa's engine: group, pack (the authors' packing rule), assign to DP ranks, price each group under its
    strategy, add switches, the per-strategy DP gradient reductions, ZeRO-1 and the update."""
    groups = group_by_boundaries(ids, lengths, gp.boundaries, field="system.boundaries")
    out = GroupedStepPrice(tokens=int(sum(int(x) for x in lengths)))
    for g, grp in zip(gp.strategies, groups):
        if grp.is_empty:  # an empty group runs no compute and contributes nothing
            out.group_compute_s.append(0.0)
            out.group_micro_batches.append(0)
            continue
        mbs = hotspa_pack(grp.seq_ids, grp.lengths, bound=grp.upper, pad=pad, align=align,
                          field=f"group {grp.lower}-{grp.upper}")
        t = pipeline_time_s(env.cost(g), assign_dp(mbs, g.dp), g.pp)
        out.group_compute_s.append(t)
        out.group_micro_batches.append(len(mbs))
        out.compute_s += t
        extra = env.replica_bytes(gp.strategies, g) if replicas else 0.0
        out.peak_memory_bytes = max(out.peak_memory_bytes,
                                    env.memory_bytes(g, max(mb.padded_len for mb in mbs)) + extra)
    layouts = _schedule(gp, [not grp.is_empty for grp in groups])
    out.order = [str(s) for s in layouts[1:]]
    out.switch_s = switches_s(env, layouts, policy, fused, replicas)
    for p in report_policies:
        out.switch_by_policy[p] = switches_s(env, layouts, p, fused, replicas)
    # Grads are reduced over each strategy's DP before they leave it (as in `examples/hotspa`): an all-reduce,
    # so every replica owns the reduced slice the switch plan reads from.
    for i, (x, y) in enumerate(zip(layouts, layouts[1:])):
        if i > 0 and x != y:
            out.dp_sync_s += env.dp_collective_s(x, GRAD_BYTES, "ar")
            out.peak_memory_bytes = max(out.peak_memory_bytes, env.switch_peak_bytes(x, y))
    out.dp_sync_s += env.dp_collective_s(gp.home, GRAD_BYTES, "rs") + env.dp_collective_s(gp.home, PARAM_BYTES, "ag")
    out.optimizer_s = env.optimizer_s()
    return out


def price_static_step(env: PricingEnv, ids, lengths, s: Strategy, capacity: int, *, pad: str, align: int,
                      parallel: str = "tp") -> GroupedStepPrice:
    """Megatron/DeepSpeed-like static: greedy packing to ``capacity``, micro-batch i on DP rank
    i mod dp (equal counts, short ranks padded with empty ones), 1F1B, ZeRO-1."""
    mbs = greedy_pack(ids, lengths, capacity, pad=pad, align=align, field="static packing")
    out = GroupedStepPrice(tokens=int(sum(int(x) for x in lengths)))
    out.compute_s = pipeline_time_s(env.cost(s, parallel), assign_dp(mbs, s.dp), s.pp)
    out.group_compute_s = [out.compute_s]
    out.group_micro_batches = [len(mbs)]
    out.order = [str(s)]
    out.dp_sync_s = env.dp_collective_s(s, GRAD_BYTES, "rs", parallel) + env.dp_collective_s(s, PARAM_BYTES, "ag", parallel)
    out.optimizer_s = env.optimizer_s()
    out.peak_memory_bytes = max((env.memory_bytes(s, mb.padded_len, parallel) for mb in mbs), default=0.0)
    return out


def enumerate_strategies(num_gpus: int, gpus_per_node: int, num_layers: int, heads: int,
                         max_tp: int) -> list[Strategy]:
    """(dp, tp, pp) with dp·tp·pp = N, tp <= max_tp dividing the node (or whole nodes past
    it), tp | heads, pp | L."""
    out = []
    for tp in range(1, min(max_tp, num_gpus) + 1):
        if num_gpus % tp or heads % tp:
            continue
        if (tp <= gpus_per_node and gpus_per_node % tp) or (tp > gpus_per_node and tp % gpus_per_node):
            continue
        for pp in range(1, num_gpus // tp + 1):
            if (num_gpus // tp) % pp or num_layers % pp:
                continue
            out.append(Strategy(num_gpus // (tp * pp), tp, pp))
    return sorted(out)


def best_static(env: PricingEnv, batches, context: int, *, grid: StaticGridConfig, pad: str, align: int
                ) -> tuple[Strategy, dict]:
    """Grid search (our static baseline, impl/hotspa/README.md "Reconstructed choices";
    :mod:`impl.common.baselines.static`): the feasible strategy (maxlen >= context) with the lowest
    mean priced step over ``batches``; ties to the smaller (dp, tp, pp)."""
    parallel, max_tp = grid.parallel, grid.max_tp
    cands = enumerate_strategies(env.N, env.gpn, env.model.num_layers, env.model.heads, max_tp)
    feasible = [s for s in cands if env.maxlen(s, parallel) >= context]
    if not feasible:
        best = max(cands, key=lambda s: env.maxlen(s, parallel), default=None)
        got = f"best maxlen {env.maxlen(best, parallel)} at {best}" if best else "no strategy at all"
        raise ConfigError(f"workload.context: {context} tokens is longer than every {parallel} strategy's maxlen "
                          f"with tp <= {max_tp} ({got}); raise {grid.field} or lower the context")
    best, scores = fastest(((s, s) for s in sorted(feasible)), lambda s: mean_step_s(
        lambda b: price_static_step(env, b.ids, b.lengths, s, context, pad=pad, align=align, parallel=parallel).step_s,
        batches))
    return best, {str(s): round(v, 6) for s, v in sorted(scores.items())}


def check_fits(env: PricingEnv, gp: GroupPlan, field: str = "system.strategies") -> None:
    """Every group's strategy must fit micro-batches of its upper bound (memory model)."""
    for g, (s, hi) in enumerate(zip(gp.strategies, gp.boundaries)):
        m = env.maxlen(s)
        if m < hi:
            raise ConfigError(f"{field}[{g}]: {s} fits micro-batches of at most {m} tokens on "
                              f"{env.mem.capacity_bytes / 2**30:.1f} GiB, below its group bound {hi}")
