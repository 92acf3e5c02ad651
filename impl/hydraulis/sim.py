"""Hydraulis sim mode (scenarios S1-S6: ``conf/experiment/hydraulis/``): every policy of :mod:`impl.hydraulis.policies` on the
same per-step batches (:func:`impl.hydraulis.batches.step_batches`, seed = job seed), priced by
:mod:`impl.hydraulis.cost.step` on the cost model of :mod:`impl.hydraulis.cost.strategy` (the Megatron step
model's time and memory by default: one pricing path for every policy). This module holds the
pricing the policies share and the run around them (:func:`simulate`); what differs per policy is
its component's ``prices`` hook.

Setup per job (all from a second stream seeded seed+1, ``system.sim.sample_steps`` steps, so a
policy never sees the batches it is measured on):
- Megatron-like grid: every homogeneous (dp, tp, pp) with tp <= ``sim.megatron_max_tp`` whose
  capacity holds the context (the shared step-model memory, ZeRO-1 over the N GPUs); the best mean step
  time wins (README "Design choices for the [R] details": Baselines). It is also the default optimizer layout of the Hydraulis policies
  (``system.opt_layout`` overrides it).
- The candidate pool: the optimizer-layout strategy, then the generator's lists (:mod:`impl.hydraulis.generator`) on the
  sample's per-step histogram.
Deterministic: ILPs stop at a node limit (``sim.ilp_node_limit``), never at the wall clock in
practice; only ``plan_time_s`` (the planner's wall time on this host) varies between runs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from impl.common.api import ConfigError, Metric, RunResult
from impl.common.baselines.hotspa_like import BucketSearch, halving_boundaries
from impl.common.baselines.megatron_grid import GridRule, GridRuleConfig
from impl.common.baselines.static import StaticGridConfig, fastest, mean_step_s
from impl.common.cost.transformer import model_params
from impl.common.megatron.step import optimizer_step_s
from impl.common.varlen.packing import assign_dp, equal_count, greedy_pack, pad_to_max

from impl.hydraulis.batches import check_budget, step_batches
from impl.common.cost.varlen_model import StrategyLayout, seq_cost

from impl.hydraulis.cost.strategy import (CAP_ROUND, GIB, CostSpec, OptLayout, ReplicaCost, StrategyMemory, check_source, fmt_strategy,
                   load_cost_data, strategy_cost, strategy_costs)
from impl.hydraulis.dispatch import dispatch
from impl.hydraulis.generator import Histogram, Pool, generate_pool
from impl.common import collectives as coll
from impl.common.cost.comm import link_efficiencies
from impl.hydraulis.cost.step import StepPrice, aligned, finish, from_micro_batches, switch_s
from impl.hydraulis.step_plan import plan_step

def cost_spec(system) -> CostSpec:
    c = system.cfg.sim.cost
    check_source(c.source)
    return CostSpec(source=c.source)


@dataclass
class SimEnv:
    wl: object
    hw: object
    system: object
    spec: CostSpec
    data: object

    @property
    def n(self) -> int:
        return self.wl.num_gpus

    def plan_kwargs(self, seed: int) -> dict:
        c = self.system.cfg
        return dict(shuffles=c.shuffles, seed=seed, v_window=c.v_window, time_limit_s=c.sim.ilp_time_limit_s,
                    node_limit=c.sim.ilp_node_limit or None, mip_rel_gap=c.mip_rel_gap,
                    includes_c=c.dispatch_includes_c, ilp_scope=c.ilp_scope, refine=c.dispatch_refine,
                    budget=c.dispatch_budget)

    @functools.cached_property
    def mem(self) -> StrategyMemory:
        """The job's planning memory (the shared step-model MemoryModel). The optimizer states
        sit in the optimizer layout, spread over all N GPUs whatever its (dp, tp, pp), so one
        memory serves every layout."""
        return StrategyMemory.for_job(self.wl.model, self.hw, self.n)


# ---------------------------------------------------------------------------- homogeneous pricing


def price_homo_greedy(env: SimEnv, r: ReplicaCost, dp: int, lengths: Sequence[int], capacity: int,
                      pad: str = "align") -> StepPrice:
    """Greedy packing of the whole step to ``capacity``, micro-batch i to DP rank i mod dp
    (equal packed micro-batch counts per rank), 1F1B per rank, the exchange."""
    ids = list(range(len(lengths)))
    mbs = greedy_pack(ids, lengths, capacity, pad=pad, align=env.system.cfg.align)
    ranks = [from_micro_batches(rk) for rk in assign_dp(mbs, dp)]
    comp, ex = finish(env.wl.model, env.hw, env.n, [r] * dp, ranks)
    return StepPrice(comp, ex, candidate=fmt_strategy([r] * dp), micro_batches=len(mbs))


def megatron_grid(env: SimEnv, sample) -> tuple[ReplicaCost, int, dict]:
    """The Megatron-like static baseline: of the homogeneous (dp, tp, pp) whose capacity holds
    the context, the fastest mean step of greedy packing to the context (ties to the smaller tp,
    then pp)."""
    wl = env.wl
    grid = StaticGridConfig(parallel="tp", max_tp=env.system.cfg.sim.megatron_max_tp, field="system.sim.megatron_max_tp")

    def layouts():
        for tp in env.spec.tp_degrees:
            for pp in env.spec.pp_degrees:
                g = tp * pp
                if tp > grid.max_tp or g > env.n or env.n % g:
                    continue
                r = strategy_cost(wl.model, env.hw, env.mem, env.spec, tp, pp, env.data)
                if r is not None and r.cap >= wl.context:
                    yield f"({env.n // g},{tp},{pp})", (r, env.n // g)

    best, scores = fastest(layouts(), lambda lay: mean_step_s(
        lambda b: price_homo_greedy(env, lay[0], lay[1], b.lengths.tolist(), wl.context).step_s, sample))
    if best is None:
        raise ConfigError(f"workload.context: no homogeneous (dp,tp,pp) of {env.n} GPUs with tp <= "
                          f"{grid.max_tp} holds {wl.context} tokens ({wl.model.name} on {env.hw.name})")
    return best[0], best[1], scores


# ---------------------------------------------------------------------------- DeepSpeed-like


def _ulysses(env: SimEnv, sp: int, zero: int) -> Optional[tuple[ReplicaCost, float]]:
    """(cost with cap, ZeRO-3 per-micro-batch gather time in ms) of Ulysses SP degree ``sp``: the
    step model's time (``seq_cost`` of ``StrategyLayout(1, sp, 1, "ulysses")``) and memory (the shared
    MemoryModel, ZeRO-1 or ZeRO-3 over all N GPUs)."""
    m = env.wl.model
    cap = env.mem.cap(sp, 1, parallel="ulysses", zero=zero)
    if cap < CAP_ROUND:
        return None
    util = env.data.util(min(sp, 16), env.hw.memory_bytes)
    r = ReplicaCost.from_seq_cost(sp, 1, seq_cost(m, StrategyLayout(1, sp, 1, "ulysses"), env.hw), cap, util)
    gather_ms = 0.0
    if zero == 3:  # params all-gathered in forward and backward, grads reduce-scattered: bf16
        gather_ms = 3 * _all_gather_s(env, 2.0 * model_params(m)) * 1e3
    return r, gather_ms


def _all_gather_s(env: SimEnv, nbytes: float) -> float:
    """Bandwidth seconds of an all-gather (or reduce-scatter) of ``nbytes`` over every GPU of the job."""
    k = coll.group_ranks_per_node(env.n, 1, env.hw.gpus_per_node)
    return coll.collective(coll.CollOp.ALL_GATHER, nbytes, env.hw, env.n, k, **link_efficiencies(env.hw)).bandwidth_s


def price_deepspeed(env: SimEnv, r: ReplicaCost, gather_ms: float, zero: int, lengths: Sequence[int]) -> StepPrice:
    dp = env.n // r.tp
    ids = list(range(len(lengths)))
    mbs = greedy_pack(ids, lengths, min(r.cap, env.wl.context), pad="align", align=env.system.cfg.align)
    # ZeRO-1: grads reduce-scattered and params all-gathered once per step over all GPUs
    # (Ulysses replicates parameters over sp), overlapping one micro-batch like the others.
    ex = _all_gather_s(env, 6.0 * model_params(env.wl.model)) if zero == 1 else 0.0
    comp, step = 0.0, 0.0
    for rank in assign_dp(mbs, dp):
        ts = [max(r.mb_time(ls) + r.b * pad, gather_ms) for ls, pad in from_micro_batches(rank) if ls]
        t = sum(ts) / 1e3
        comp = max(comp, t)
        step = max(step, t + max(0.0, ex - (max(ts) / 1e3 if ts else 0.0)))
    return StepPrice(comp, step - comp, candidate=f"zero{zero} sp{r.tp} dp{dp}", micro_batches=len(mbs))


def deepspeed_grid(env: SimEnv, sample):
    """The DeepSpeed-like static baseline: of ZeRO stage x Ulysses degree (powers of two dividing
    the GPUs and the heads) whose capacity holds the context, the fastest mean step."""
    heads = env.wl.model.heads

    def layouts():
        for zero in env.system.cfg.sim.deepspeed_zero_stages:
            if zero not in (1, 3):
                raise ConfigError(f"system.sim.deepspeed_zero_stages: {zero} is not a supported stage (1 or 3)")
            sp = 1
            while sp <= env.n:
                if env.n % sp == 0 and heads % sp == 0:
                    got = _ulysses(env, sp, zero)
                    if got is not None and got[0].cap >= env.wl.context:
                        yield f"zero{zero}_sp{sp}", (got[0], got[1], zero)
                sp *= 2

    best, scores = fastest(layouts(), lambda lay: mean_step_s(
        lambda b: price_deepspeed(env, lay[0], lay[1], lay[2], b.lengths.tolist()).step_s, sample))
    if best is None:
        raise ConfigError(f"workload.context: no ZeRO-1/3 + Ulysses layout of {env.n} GPUs holds "
                          f"{env.wl.context} tokens ({env.wl.model.name})")
    return best[0], best[1], best[2], scores


# ---------------------------------------------------------------------------- Megatron by the grid rule


def megatron_grid_prices(env: SimEnv, sample, batches) -> tuple[list, dict]:
    """Megatron-like by the HotSPa authors' grid rule (:mod:`impl.common.baselines.megatron_grid`,
    on token-budget steps) on the calibrated Megatron step model; the fastest mean step on the
    sample steps wins among layouts that fit. Any profile: a datasheet one is priced with the
    knobs and kernel tables carried from ``hardware.megatron.carried_from`` (impl.common.megatron.derive)."""
    rule = GridRule(GridRuleConfig(token_budget_steps=True), env.wl, env.hw)
    best, ginfo = rule.search(sample)
    ests = rule.estimates(best, batches)
    prices = [StepPrice(e.iteration_s - e.breakdown_s["per_iteration_s"], 0.0, candidate=str(best),
                        overhead_s=e.breakdown_s["per_iteration_s"]) for e in ests]
    info = {"megatron_grid_layout": str(best), **ginfo,
            "fits_every_step": all(e.fits for e in ests), "breakdown_step0": ests[0].breakdown_s}
    return prices, info


# ---------------------------------------------------------------------------- HotSPa-like


def hotspa_boundaries(env: SimEnv) -> list[int]:
    return halving_boundaries(env.wl.context, env.system.cfg.sim.hotspa_boundaries)


def _group_lengths(lengths: Sequence[int], hi: int, lo: int) -> list[int]:
    return [x for x in lengths if lo < x <= hi]


def price_groups(env: SimEnv, bounds: Sequence[int], strategies: Sequence[ReplicaCost], lengths: Sequence[int]) -> StepPrice:
    """One step under fixed groups (``bounds``) and one homogeneous strategy per group."""
    total, chosen, nmb, last = 0.0, [], 0, None
    for (hi, lo), r in zip(zip(bounds, bounds[1:]), strategies):
        g_lens = _group_lengths(lengths, hi, lo)
        if not g_lens:
            continue  # an empty group runs nothing and switches nothing
        p = price_homo_greedy(env, r, env.n // r.gpus, g_lens, min(r.cap, hi))
        total += p.compute_s
        chosen.append(r)
        nmb += p.micro_batches
        last = p
    sw = sum(switch_s(env.wl.model, env.hw, env.n, b) for a, b in zip(chosen, chosen[1:]) if a != b)
    if chosen[-1] != chosen[0]:
        sw += switch_s(env.wl.model, env.hw, env.n, chosen[0])  # back to the first group's layout
    # the step's gradients leave with the last group: its exposed exchange (same overlap rule)
    return StepPrice(total, last.exchange_s, sw, candidate=" | ".join(fmt_strategy([r]) for r in chosen),
                     micro_batches=nmb)


def hotspa_plan(env: SimEnv, strategies: Sequence[ReplicaCost], bounds: Sequence[int], sample) -> tuple[list, list]:
    """HotSPa 2.7 offline [R] (:mod:`impl.common.baselines.hotspa_like`): every merge of the
    candidate boundaries; per group the homogeneous strategy (N divisible by tp·pp, capacity >=
    the group's bound) fastest on the sample steps; the merge with the smallest mean sample step
    time. Fixed for the run."""
    homo = [r for r in strategies if env.n % r.gpus == 0]

    def choose(lo: int, hi: int) -> ReplicaCost:
        fits = [r for r in homo if r.cap >= min(hi, env.wl.context)]
        if not fits:
            raise ConfigError(f"hotspa_like: no homogeneous strategy of {env.n} GPUs holds the {lo}-{hi} group")
        groups = [_group_lengths(x.lengths.tolist(), hi, lo) for x in sample]
        return min(fits, key=lambda r: sum(price_homo_greedy(env, r, env.n // r.gpus, g, min(r.cap, hi)).compute_s
                                           for g in groups if g))

    def mean_step(b, strat) -> float:
        return statistics.fmean(price_groups(env, b, strat, x.lengths.tolist()).step_s for x in sample)

    _, b, strat, _ = BucketSearch(order="mask").search(bounds[0], list(bounds[1:-1]), choose, mean_step)
    return b, strat


# ---------------------------------------------------------------------------- Hydraulis policies


def price_plan(env: SimEnv, lengths: Sequence[int], plan) -> StepPrice:
    """A StepPlan's micro-batches with alignment padding, plus the exchange."""
    align = env.system.cfg.align
    per = [[aligned([lengths[i] for i in mb], align) for mb in rp.micro_batches] for rp in plan.replicas]
    reps = [rp.replica for rp in plan.replicas]
    comp, ex = finish(env.wl.model, env.hw, env.n, reps, per)
    return StepPrice(comp, ex, plan_time_s=plan.plan_time_s,
                     candidate=fmt_strategy(reps), statuses=dict(plan.statuses),
                     micro_batches=sum(len(rp.micro_batches) for rp in plan.replicas))


def price_greedy_dynamic(env: SimEnv, pool, lengths: Sequence[int], seed: int) -> StepPrice:
    """Mode 3: stage-1 dispatch over each candidate, greedy packing per replica to the context
    length (the fixed-length packing of the artifact; dynamic shape: padded to ``align``)."""
    t0 = time.perf_counter()
    c = env.system.cfg
    best = None
    for cand in pool:
        if max(r.cap for r in cand) < max(lengths):
            continue
        d = dispatch(lengths, cand, shuffles=c.shuffles, seed=seed, includes_c=c.dispatch_includes_c,
                     refine=c.dispatch_refine, budget=c.dispatch_budget)
        if not d.feasible:
            continue
        per, nmb = [], 0
        for r, idx in zip(cand, d.assign):
            mbs = greedy_pack(idx, [lengths[i] for i in idx], min(r.cap, env.wl.context), pad="align", align=c.align)
            per.append(from_micro_batches(mbs))
            nmb += len(mbs)
        comp, ex = finish(env.wl.model, env.hw, env.n, cand, per)
        if best is None or comp < best[0]:  # the planner ranks compute, like mode 4's score
            best = (comp, cand, nmb, ex)
    if best is None:
        raise ConfigError("strategy pool: no candidate runs this batch (every one leaves a replica empty)")
    return StepPrice(best[0], best[3], plan_time_s=time.perf_counter() - t0, candidate=fmt_strategy(best[1]),
                     micro_batches=best[2])


def _homo_price(env: SimEnv, r: ReplicaCost, R: int, ranks: list) -> StepPrice:
    comp, ex = finish(env.wl.model, env.hw, env.n, [r] * R, ranks)
    return StepPrice(comp, ex, candidate=fmt_strategy([r] * R),
                     micro_batches=sum(len(rk) for rk in ranks))


def price_pad(env: SimEnv, r: ReplicaCost, R: int, lengths: Sequence[int]) -> StepPrice:
    """Mode 0 on the optimizer-layout strategy (R replicas of ``r``): longest first, dealt round
    robin, every rank's micro-batches rows of the step's longest sequence."""
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    s_max = max(lengths)
    ranks = []
    for idx in (order[k::R] for k in range(R)):
        ls = [lengths[i] for i in idx]
        ranks.append(from_micro_batches(pad_to_max(idx, ls, max(1, r.cap // s_max), row_len=s_max)) if idx else [])
    return _homo_price(env, r, R, ranks)


def price_equal(env: SimEnv, r: ReplicaCost, R: int, lengths: Sequence[int]) -> StepPrice:
    """Mode 1: dealt round robin in arrival order, each rank's share in the fewest equal-count
    micro-batches that fit the capacity."""
    align = env.system.cfg.align
    n = len(lengths)
    order = list(range(n))
    ranks = []
    for idx in (order[k::R] for k in range(R)):
        ls = [lengths[i] for i in idx]
        if not idx:
            ranks.append([])
            continue
        v = max(1, math.ceil(sum(ls) / r.cap))
        while True:
            try:
                mbs = equal_count(idx, ls, v, capacity=r.cap, pad="align", align=align)
                break
            except ConfigError:
                v += 1
        ranks.append(from_micro_batches(mbs))
    return _homo_price(env, r, R, ranks)


def price_greedy_static(env: SimEnv, r: ReplicaCost, R: int, lengths: Sequence[int]) -> StepPrice:
    """Mode 2: greedy packing to the capacity, static shape (rows of the context length)."""
    n = len(lengths)
    mbs = greedy_pack(list(range(n)), lengths, min(r.cap, env.wl.context), pad="bound", align=env.system.cfg.align)
    ranks = [from_micro_batches(rk) for rk in assign_dp(mbs, R)]
    return _homo_price(env, r, R, ranks)


# ---------------------------------------------------------------------------- setup and run


def generator_params(system, wl) -> tuple[int, int]:
    step = system.cfg.generator_step or (1024 if wl.model.hidden >= 6144 else 128)
    delta = system.cfg.generator_delta_n or (4 if wl.num_gpus >= 256 and wl.num_gpus % 4 == 0 else 1)
    return step, delta


def parse_pool(text: Sequence[str], num_gpus: int) -> list[list[tuple[int, int]]]:
    """``system.pool`` entries like ``"(16,1) + (8,1)x6"`` -> lists of (tp, pp) per replica."""
    import re

    out = []
    for i, entry in enumerate(text):
        reps: list[tuple[int, int]] = []
        for part in str(entry).split("+"):
            m = re.fullmatch(r"\s*(?:(\d+)\s*x\s*)?\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*(?:x\s*(\d+))?\s*", part)
            if not m or (m.group(1) and m.group(4)):
                raise ConfigError(f"system.pool[{i}]: {part.strip()!r} is not '(tp,pp)', '(tp,pp)xK' or 'Kx(tp,pp)'")
            k = int(m.group(1) or m.group(4) or 1)
            tp, pp = int(m.group(2)), int(m.group(3))
            if k < 1 or tp < 1 or pp < 1:
                raise ConfigError(f"system.pool[{i}]: {part.strip()!r} needs tp, pp, count >= 1")
            reps += [(tp, pp)] * k
        used = sum(tp * pp for tp, pp in reps)
        if used != num_gpus:
            raise ConfigError(f"system.pool[{i}]: {entry!r} uses {used} GPUs, not workload.num_gpus {num_gpus}")
        out.append(reps)
    return out


POOL_SOURCES = ("auto", "generator")


def script_pool(env: SimEnv) -> tuple[list, str]:
    """(lists, source) of ``system.pool``, or of ``impl/hydraulis/data/pools.yaml`` for this
    (model, GPUs, memory class) when ``system.pool_source`` is auto; ([], "") = the generator."""
    c = env.system.cfg
    if c.pool_source not in POOL_SOURCES:
        raise ConfigError(f"system.pool_source: unknown {c.pool_source!r} (one of: {', '.join(POOL_SOURCES)})")
    if c.pool:
        return list(c.pool), "system.pool"
    if c.pool_source == "generator":
        return [], ""
    import pathlib
    from importlib import resources

    from omegaconf import OmegaConf

    path = pathlib.Path(str(resources.files("impl.hydraulis").joinpath("data", "pools.yaml")))
    cls = env.data.memory_class(env.hw.memory_bytes)
    for e in OmegaConf.to_container(OmegaConf.load(path))["pools"]:
        if e["model"] == env.wl.model.name and int(e["num_gpus"]) == env.n and e["gpu_memory_class"] == cls:
            return list(e["lists"]), str(e["source"])
    return [], ""


def fixed_pool(env: SimEnv, mem: StrategyMemory, strategies: list, opt: OptLayout, text: Sequence[str], src: str) -> Pool:
    """Fixed candidate lists (the authors' scripts, ``impl/hydraulis/data/pools.yaml``), each strategy priced like the
    generator's (also outside the enumerated degrees, e.g. (8,3))."""
    lists = parse_pool(text, env.n)
    known = {(r.tp, r.pp): r for r in strategies}
    cands = []
    for i, reps in enumerate(lists):
        row = []
        for tp, pp in reps:
            if (tp, pp) not in known:
                r = strategy_cost(env.wl.model, env.hw, mem, env.spec, tp, pp, env.data)
                if r is None:
                    raise ConfigError(f"system.pool[{i}]: strategy ({tp},{pp}) has no price or cannot hold a "
                                      f"128-token micro-batch ({env.wl.model.name} on {env.n} {env.hw.name})")
                known[(tp, pp)] = r
            row.append(known[(tp, pp)])
        cands.append(row)
    return Pool(cands, [src] * len(cands), [math.nan] * len(cands), len(cands))


def build_pool(env: SimEnv, sample, opt: OptLayout):
    wl = env.wl
    mem = env.mem
    strategies = strategy_costs(wl.model, env.hw, mem, env.spec, env.n, env.data)
    text, src = script_pool(env)
    if text:
        pool = fixed_pool(env, mem, strategies, opt, text, src)
        return pool, sorted({r for c in pool.candidates for r in c} | set(strategies), key=lambda r: (r.gpus, r.tp)), mem
    layout = [r for r in strategies if (r.tp, r.pp) == (opt.tp, opt.pp)]
    if not layout:
        raise ConfigError(f"system.opt_layout: strategy (tp {opt.tp}, pp {opt.pp}) of layout {opt} has no price or "
                          f"cannot hold a 128-token micro-batch ({wl.model.name} on {env.n} {env.hw.name})")
    step, delta = generator_params(env.system, wl)
    lengths = [x for b in sample for x in b.lengths.tolist()]
    h = Histogram.from_lengths(lengths, step, weight=1.0 / len(sample))
    ml = {(r.tp, r.pp): mem.maxlen(r.tp, r.pp) for r in strategies}
    usable = [r for r in strategies if env.n % 1 == 0]
    pool = generate_pool(h, usable, env.n, layout * opt.dp, maxlen=[ml[(r.tp, r.pp)] for r in usable],
                         delta_n=delta, max_candidates=env.system.cfg.max_candidates)
    return pool, strategies, mem


def check_sim(system, wl, hardware) -> None:
    if "bf16" not in hardware.peak_flops:
        raise ConfigError(f"hardware {hardware.name}: sim mode prices bf16 compute, which the profile lacks")
    check_budget(wl)
    k = system.cfg.sim
    if k.sample_steps < 1:
        raise ConfigError(f"system.sim.sample_steps: must be >= 1, got {k.sample_steps}")
    StaticGridConfig(max_tp=k.megatron_max_tp, field="system.sim.megatron_max_tp")  # one line if < 1
    if k.ilp_node_limit < 0 or k.ilp_time_limit_s <= 0:
        raise ConfigError(f"system.sim.ilp_node_limit ({k.ilp_node_limit}) must be >= 0 and ilp_time_limit_s "
                          f"({k.ilp_time_limit_s}) > 0")
    if system.cfg.opt_layout:
        dp, tp, pp = system.cfg.opt_layout
        if dp * tp * pp != wl.num_gpus:
            raise ConfigError(f"system.opt_layout: {list(system.cfg.opt_layout)} uses {dp * tp * pp} GPUs, not "
                              f"workload.num_gpus {wl.num_gpus}")
    cost_spec(system)


@dataclass
class SimRun:
    """One job's inputs to a policy's ``prices`` hook, and the info it adds to."""

    sample: list  # planning steps (stream seed+1)
    batches: list  # measured steps (stream seed)
    seed: int
    info: dict
    mega_r: ReplicaCost  # the Megatron-like grid's best layout: the default optimizer layout
    mega_dp: int
    grid: dict  # the Megatron-like grid's mean step per layout


@dataclass
class PoolRun:
    """The candidate pool of the Hydraulis-engine policies and what plans on it."""

    pool: Pool
    strategies: list
    mem: StrategyMemory
    opt: OptLayout
    kw: dict  # plan_step knobs


def pool_run(env: SimEnv, run: SimRun) -> PoolRun:
    """The optimizer layout (``system.opt_layout``, the scripts' first list, or the Megatron-like
    grid's), the candidate pool on it, recorded in the run's info."""
    cfg = env.system.cfg
    opt = OptLayout(*cfg.opt_layout) if cfg.opt_layout else OptLayout(run.mega_dp, run.mega_r.tp, run.mega_r.pp)
    text, _ = script_pool(env)
    if text and not cfg.opt_layout:
        first = parse_pool(text[:1], env.n)[0]
        if len(set(first)) == 1:  # the scripts' first list is the optimizer layout
            opt = OptLayout(len(first), *first[0])
    pool, strategies, mem = build_pool(env, run.sample, opt)
    run.info.update(opt_layout=str(opt), pool=pool.describe(), pool_raw_lists=pool.raw_lists,
                    strategies={r.label(): {"a": r.a, "b": r.b, "c": r.c, "cap": r.cap, "util": r.util}
                                for r in strategies})
    return PoolRun(pool, strategies, mem, opt, env.plan_kwargs(run.seed))


def price_planned(env: SimEnv, run: SimRun, pr: PoolRun, cands: list, rule: str,
                  fallback: Optional[list] = None) -> list[StepPrice]:
    """Every step planned by the full planner (:func:`plan_step`) over ``cands`` with dispatch
    ``rule``; a step the candidates cannot run (a replica left empty) runs ``fallback`` when
    given (counted in ``static_fallback_steps``), else fails."""
    prices, fell = [], 0
    for b in run.batches:
        ls = b.lengths.tolist()
        try:
            plan = plan_step(ls, cands, dispatch_rule=rule, **pr.kw)
        except ConfigError:
            if fallback is None:
                raise
            fell += 1
            plan = plan_step(ls, fallback, **pr.kw)
        prices.append(price_plan(env, ls, plan))
        peak = max(pr.mem.bytes_at(rp.replica.tp, rp.replica.pp, sum(ls[i] for i in mb))
                   for rp in plan.replicas for mb in rp.micro_batches)
        run.info["peak_memory_gib"] = max(run.info.get("peak_memory_gib", 0.0), peak / GIB)
    if fallback is not None:
        run.info["static_fallback_steps"] = fell
    return prices


def simulate(system, wl, hw, seed: int) -> tuple[dict, dict]:
    policy = system.component
    env = SimEnv(wl, hw, system, cost_spec(system), load_cost_data())
    cfg = system.cfg
    sample = step_batches(wl, seed + 1, cfg.sim.sample_steps)
    batches = step_batches(wl, seed, wl.steps)
    info: dict = {"num_gpus": wl.num_gpus, "context": wl.context, "token_budget": wl.token_budget,
                  "dataset": wl.dataset, "model": wl.model.name}
    mega_r, mega_dp, grid = megatron_grid(env, sample)
    info["megatron_layout"] = f"({mega_dp},{mega_r.tp},{mega_r.pp})"
    prices = policy.prices(env, SimRun(sample, batches, seed, info, mega_r, mega_dp, grid))
    if policy.adds_iteration_overhead:
        # [R] one rule for every policy (and every training system of the harness): the step
        # model's per-iteration terms, Adam over the optimizer layout's shard (the whole model over
        # the N GPUs) and the fork's measured host/launch overhead carried to datasheet profiles,
        # which the grid baseline pays inside its iteration too
        over = optimizer_step_s(float(model_params(wl.model)), wl.num_gpus, hw)
        prices = [dataclasses.replace(p, overhead_s=over) for p in prices]
        info["iteration_overhead_s"] = over
    return metrics_of(prices, batches, info, wl.steps)


def metrics_of(prices: list, batches, info: dict, steps_run: int) -> tuple[dict, dict]:
    steps = [p.step_s for p in prices]
    tokens = sum(int(b.lengths.sum()) for b in batches)
    m = {
        "step_time_s": Metric.from_samples(steps, "s"),
        "tokens_per_s": Metric.scalar(tokens / sum(steps), "tokens/s", "higher"),
        "throughput_tokens_per_s": Metric.scalar(tokens / sum(steps), "tokens/s", "higher"),
        "compute_time_s": Metric.from_samples([p.compute_s for p in prices], "s"),
        "exchange_time_s": Metric.from_samples([p.exchange_s for p in prices], "s"),
        "switch_time_s": Metric.from_samples([p.switch_s for p in prices], "s"),
        "micro_batches": Metric.from_samples([p.micro_batches for p in prices], "count"),
        "overhead_time_s": Metric.from_samples([p.overhead_s for p in prices], "s"),
    }
    if any(p.plan_time_s for p in prices):
        m["plan_time_s"] = Metric.from_samples([p.plan_time_s for p in prices], "s")
        m["plan_to_step_ratio"] = Metric.scalar(max(p.plan_time_s / p.step_s for p in prices), "ratio")
        # S5 (planner scalability, README "Sim results"): the share of steps whose plan hides behind the step before it
        m["plan_hidden_fraction"] = Metric.scalar(sum(p.plan_time_s < p.step_s for p in prices) / len(prices),
                                                  "ratio", "higher")
    status = Counter()
    for p in prices:
        status.update(p.statuses or {})
    if status:
        info["ilp_status_counts"] = dict(status)
        m["ilp_limit_fraction"] = Metric.scalar(status.get("limit", 0) / sum(status.values()), "ratio")
    info["winner_per_step"] = [p.candidate for p in prices]
    info["winner_counts"] = dict(Counter(p.candidate for p in prices))
    info["steps"] = steps_run
    return m, info


def static_choice(pool, sample, kw) -> list:
    """Static-hetero ablation: the candidate the full planner picks most often on the sample
    steps (ties: the earlier in the pool), then used for every step."""
    wins = Counter(plan_step(b.lengths.tolist(), pool, **kw).candidate for b in sample)
    return pool[min(wins, key=lambda i: (-wins[i], i))]


def run_sim(system, job) -> RunResult:
    metrics, info = simulate(system, job.workload, job.hardware, job.seed)
    return RunResult(metrics=metrics, info=info)
