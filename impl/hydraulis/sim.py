"""Hydraulis sim mode (spec hydraulis 6): every policy of :mod:`impl.hydraulis.system` on the
same per-step batches (:func:`impl.hydraulis.batches.step_batches`, seed = job seed), priced by
:mod:`impl.hydraulis.pricing` on the cost model of :mod:`impl.hydraulis.cost`.

Setup per job (all from a second stream seeded seed+1, ``system.sim.sample_steps`` steps, so a
policy never sees the batches it is measured on):
- Megatron-like grid: every homogeneous (dp, tp, pp) with tp <= ``sim.megatron_max_tp`` whose
  capacity holds the context, its own distributed-optimizer memory layout; the best mean step
  time wins (spec 3). It is also the default optimizer layout of the Hydraulis policies
  (``system.opt_layout`` overrides it).
- The candidate pool: the optimizer-layout strategy, then the generator's lists (2.3) on the
  sample's per-step histogram.
Deterministic: ILPs stop at a node limit (``sim.ilp_node_limit``), never at the wall clock in
practice; only ``plan_time_s`` (the planner's wall time on this host) varies between runs.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from impl.common.api import ConfigError, Metric, RunResult
from impl.common.varlen.packing import assign_dp, equal_count, greedy_pack, pad_to_max

from .batches import check_budget, step_batches
from .cost import (CAP_ROUND, GIB, CostSpec, MemoryModel, OptLayout, ReplicaCost, derived_seq_cost, fmt_strategy,
                   load_cost_data, published_c_per_layer_ms, strategy_cost, strategy_costs)
from .dispatch import dispatch
from .generator import Histogram, generate_pool
from .pricing import StepPrice, aligned, finish, from_micro_batches, link_bw, switch_s
from .step_plan import plan_step

HOMO_MODES = ("hydraulis_pad", "hydraulis_equal", "hydraulis_greedy_static")
POOL_POLICIES = ("hydraulis", "hydraulis_greedy_dynamic", "hydraulis_token_balanced", "hydraulis_static_hetero")


def cost_spec(system) -> CostSpec:
    c = system.cfg.sim.cost
    return CostSpec(source=c.source, mfu=c.mfu, causal=c.causal, c_per_layer_ms=c.c_per_layer_ms)


@dataclass
class Env:
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
                    includes_c=c.dispatch_includes_c, ilp_scope=c.ilp_scope)

    def mem(self, opt: OptLayout) -> MemoryModel:
        return MemoryModel.for_model(self.wl.model, self.hw.memory_bytes, opt, self.data)


# ---------------------------------------------------------------------------- homogeneous pricing


def price_homo_greedy(env: Env, r: ReplicaCost, dp: int, lengths: Sequence[int], capacity: int,
                      pad: str = "align") -> StepPrice:
    """Greedy packing of the whole step to ``capacity``, micro-batch i to DP rank i mod dp
    (equal packed micro-batch counts per rank, spec 3), 1F1B per rank, the exchange."""
    ids = list(range(len(lengths)))
    mbs = greedy_pack(ids, lengths, capacity, pad=pad, align=env.system.cfg.align)
    ranks = [from_micro_batches(rk) for rk in assign_dp(mbs, dp)]
    comp, ex = finish(env.wl.model, env.hw, env.n, [r] * dp, ranks)
    return StepPrice(comp, ex, candidate=fmt_strategy([r] * dp), micro_batches=len(mbs))


def megatron_grid(env: Env, sample) -> tuple[ReplicaCost, int, dict]:
    wl, k = env.wl, env.system.cfg.sim
    scores, best = {}, None
    for tp in env.spec.tp_degrees:
        for pp in env.spec.pp_degrees:
            g = tp * pp
            if tp > k.megatron_max_tp or g > env.n or env.n % g:
                continue
            dp = env.n // g
            r = strategy_cost(wl.model, env.hw, env.mem(OptLayout(dp, tp, pp)), env.spec, tp, pp, env.data)
            if r is None or r.cap < wl.context:
                continue
            ts = [price_homo_greedy(env, r, dp, b.lengths.tolist(), wl.context).step_s for b in sample]
            scores[f"({dp},{tp},{pp})"] = statistics.fmean(ts)
            if best is None or scores[f"({dp},{tp},{pp})"] < best[0]:
                best = (scores[f"({dp},{tp},{pp})"], r, dp)
    if best is None:
        raise ConfigError(f"workload.context: no homogeneous (dp,tp,pp) of {env.n} GPUs with tp <= "
                          f"{k.megatron_max_tp} holds {wl.context} tokens ({wl.model.name} on {env.hw.name})")
    return best[1], best[2], scores


# ---------------------------------------------------------------------------- DeepSpeed-like


def _ulysses(env: Env, sp: int, zero: int) -> Optional[tuple[ReplicaCost, float]]:
    """(cost with cap, ZeRO-3 per-micro-batch gather time in ms) of Ulysses SP degree ``sp``."""
    wl, mp = env.wl, env.data.memory
    m = wl.model
    L, H, V = m.num_layers, m.hidden, m.vocab
    state_h2 = L * H * H * mp.state_bytes_per_h2
    state_v = H * V * mp.vocab_bytes_pp1
    al = mp.shardable_fraction
    if zero == 3:
        p = (state_h2 + state_v) / env.n
    else:
        p = (state_h2 + state_v) * (al / env.n + (1 - al))
    room = env.hw.memory_bytes - mp.safe_bytes(m.name) - p - mp.gap_gib * GIB
    per_tok = L * H / sp * mp.a_tp(1)
    cap = max(0, int(math.floor(room / per_tok / CAP_ROUND)) * CAP_ROUND)
    if cap < CAP_ROUND:
        return None
    c_ms = env.spec.c_per_layer_ms if env.spec.c_per_layer_ms >= 0 else published_c_per_layer_ms(env.data, memory_bytes=env.hw.memory_bytes)
    sc = derived_seq_cost(m, sp, 1, env.hw, env.spec.mfu, env.spec.causal, c_ms / 1e3, parallel="ulysses")
    util = env.data.util(min(sp, 16), env.hw.memory_bytes)
    r = ReplicaCost.from_seq_cost(sp, 1, sc, cap, util)
    from impl.common.cost.transformer import model_params

    gather_ms = 0.0
    if zero == 3:  # params all-gathered in forward and backward, grads reduce-scattered: bf16
        gather_ms = 3 * 2.0 * model_params(m) * (env.n - 1) / env.n / link_bw(env.hw, env.n) * 1e3
    return r, gather_ms


def price_deepspeed(env: Env, r: ReplicaCost, gather_ms: float, zero: int, lengths: Sequence[int]) -> StepPrice:
    dp = env.n // r.tp
    ids = list(range(len(lengths)))
    mbs = greedy_pack(ids, lengths, min(r.cap, env.wl.context), pad="align", align=env.system.cfg.align)
    from impl.common.cost.transformer import model_params

    # ZeRO-1: grads reduce-scattered and params all-gathered once per step over all GPUs
    # (Ulysses replicates parameters over sp), overlapping one micro-batch like the others.
    ex = 6.0 * model_params(env.wl.model) * (env.n - 1) / env.n / link_bw(env.hw, env.n) if zero == 1 else 0.0
    comp, step = 0.0, 0.0
    for rank in assign_dp(mbs, dp):
        ts = [max(r.mb_time(ls) + r.b * pad, gather_ms) for ls, pad in from_micro_batches(rank) if ls]
        t = sum(ts) / 1e3
        comp = max(comp, t)
        step = max(step, t + max(0.0, ex - (max(ts) / 1e3 if ts else 0.0)))
    return StepPrice(comp, step - comp, candidate=f"zero{zero} sp{r.tp} dp{dp}", micro_batches=len(mbs))


def deepspeed_grid(env: Env, sample):
    best, scores = None, {}
    heads = env.wl.model.heads
    for zero in env.system.cfg.sim.deepspeed_zero_stages:
        if zero not in (1, 3):
            raise ConfigError(f"system.sim.deepspeed_zero_stages: {zero} is not a supported stage (1 or 3)")
        sp = 1
        while sp <= env.n:
            if env.n % sp == 0 and heads % sp == 0:
                got = _ulysses(env, sp, zero)
                if got is not None and got[0].cap >= env.wl.context:
                    t = statistics.fmean(price_deepspeed(env, got[0], got[1], zero, b.lengths.tolist()).step_s
                                         for b in sample)
                    scores[f"zero{zero}_sp{sp}"] = t
                    if best is None or t < best[0]:
                        best = (t, got[0], got[1], zero)
            sp *= 2
    if best is None:
        raise ConfigError(f"workload.context: no ZeRO-1/3 + Ulysses layout of {env.n} GPUs holds "
                          f"{env.wl.context} tokens ({env.wl.model.name})")
    return best[1], best[2], best[3], scores


# ---------------------------------------------------------------------------- HotSPa-like


def hotspa_boundaries(env: Env) -> list[int]:
    b = list(env.system.cfg.sim.hotspa_boundaries)
    if not b:
        b, x = [], env.wl.context
        while x >= 2048:
            b.append(x)
            x //= 2
    if sorted(b, reverse=True) != b or b[0] < env.wl.context:
        raise ConfigError(f"system.sim.hotspa_boundaries: {b} must be descending with the first >= "
                          f"workload.context {env.wl.context}")
    return b + [0]


def _price_groups(env: Env, homo: Sequence[ReplicaCost], bounds: Sequence[int], lengths: Sequence[int]) -> StepPrice:
    total, chosen, nmb, last = 0.0, [], 0, None
    for hi, lo in zip(bounds, bounds[1:]):
        g_lens = [x for x in lengths if lo < x <= hi]
        if not g_lens:
            continue
        best = None
        for r in homo:
            if r.cap < max(g_lens):
                continue
            p = price_homo_greedy(env, r, env.n // r.gpus, g_lens, min(r.cap, hi))
            if best is None or p.compute_s < best[0]:
                best = (p.compute_s, r, p)
        if best is None:
            raise ConfigError(f"hotspa_like: no homogeneous strategy holds the {lo}-{hi} group's {max(g_lens)} tokens")
        total += best[0]
        chosen.append(best[1])
        nmb += best[2].micro_batches
        last = best[2]
    sw = sum(switch_s(env.wl.model, env.hw, env.n, b) for a, b in zip(chosen, chosen[1:]) if a != b)
    if chosen[-1] != chosen[0]:
        sw += switch_s(env.wl.model, env.hw, env.n, chosen[0])
    # the step's gradients leave with the last group: its exposed exchange (same overlap rule)
    return StepPrice(total, last.exchange_s, sw, candidate=" | ".join(fmt_strategy([r]) for r in chosen),
                     micro_batches=nmb)


def price_hotspa(env: Env, strategies: Sequence[ReplicaCost], bounds: Sequence[int], lengths: Sequence[int]) -> StepPrice:
    """Length groups, each packed to its upper bound (HotSPa 2.3) and run under its fastest
    homogeneous strategy, hot switches between them. Per step, every merge of the candidate
    boundaries is tried and the fastest kept (an oracle choice of groups and strategies:
    favourable to the baseline; HotSPa 2.7 fixes them offline)."""
    homo = [r for r in strategies if env.n % r.gpus == 0]
    inner = list(bounds[1:-1])
    best = None
    for mask in range(2 ** len(inner)):
        keep = [b for i, b in enumerate(inner) if mask >> i & 1]
        p = _price_groups(env, homo, [bounds[0], *keep, 0], lengths)
        if best is None or p.step_s < best.step_s:
            best = p
    return best


# ---------------------------------------------------------------------------- Hydraulis policies


def price_plan(env: Env, lengths: Sequence[int], plan) -> StepPrice:
    """A StepPlan's micro-batches with alignment padding, plus the exchange."""
    align = env.system.cfg.align
    per = [[aligned([lengths[i] for i in mb], align) for mb in rp.micro_batches] for rp in plan.replicas]
    reps = [rp.replica for rp in plan.replicas]
    comp, ex = finish(env.wl.model, env.hw, env.n, reps, per)
    return StepPrice(comp, ex, plan_time_s=plan.plan_time_s,
                     candidate=fmt_strategy(reps), statuses=dict(plan.statuses),
                     micro_batches=sum(len(rp.micro_batches) for rp in plan.replicas))


def price_greedy_dynamic(env: Env, pool, lengths: Sequence[int], seed: int) -> StepPrice:
    """Mode 3: stage-1 dispatch over each candidate, greedy packing per replica to the context
    length (the fixed-length packing of the artifact; dynamic shape: padded to ``align``)."""
    t0 = time.perf_counter()
    c = env.system.cfg
    best = None
    for cand in pool:
        if max(r.cap for r in cand) < max(lengths):
            continue
        d = dispatch(lengths, cand, shuffles=c.shuffles, seed=seed, includes_c=c.dispatch_includes_c)
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


def price_homo_mode(env: Env, policy: str, r: ReplicaCost, R: int, lengths: Sequence[int]) -> StepPrice:
    """Modes 0-2 on the optimizer-layout strategy (R replicas of ``r``)."""
    align = env.system.cfg.align
    n = len(lengths)
    if policy == "hydraulis_greedy_static":  # static shape: rows of the context length
        mbs = greedy_pack(list(range(n)), lengths, min(r.cap, env.wl.context), pad="bound", align=align)
        ranks = [from_micro_batches(rk) for rk in assign_dp(mbs, R)]
    else:
        order = sorted(range(n), key=lambda i: (-lengths[i], i)) if policy == "hydraulis_pad" else list(range(n))
        per = [order[k::R] for k in range(R)]
        ranks = []
        for idx in per:
            ls = [lengths[i] for i in idx]
            if not idx:
                ranks.append([])
            elif policy == "hydraulis_pad":
                s_max = max(lengths)
                ranks.append(from_micro_batches(pad_to_max(idx, ls, max(1, r.cap // s_max), row_len=s_max)))
            else:
                v = max(1, math.ceil(sum(ls) / r.cap))
                while True:
                    try:
                        mbs = equal_count(idx, ls, v, capacity=r.cap, pad="align", align=align)
                        break
                    except ConfigError:
                        v += 1
                ranks.append(from_micro_batches(mbs))
    comp, ex = finish(env.wl.model, env.hw, env.n, [r] * R, ranks)
    return StepPrice(comp, ex, candidate=fmt_strategy([r] * R),
                     micro_batches=sum(len(rk) for rk in ranks))


# ---------------------------------------------------------------------------- setup and run


def generator_params(system, wl) -> tuple[int, int]:
    step = system.cfg.generator_step or (1024 if wl.model.hidden >= 6144 else 128)
    delta = system.cfg.generator_delta_n or (4 if wl.num_gpus >= 256 and wl.num_gpus % 4 == 0 else 1)
    return step, delta


def build_pool(env: Env, sample, opt: OptLayout):
    wl = env.wl
    mem = env.mem(opt)
    strategies = strategy_costs(wl.model, env.hw, mem, env.spec, env.n, env.data)
    layout = [r for r in strategies if (r.tp, r.pp) == (opt.tp, opt.pp)]
    if not layout:
        raise ConfigError(f"system.opt_layout: strategy (tp {opt.tp}, pp {opt.pp}) has no price or cannot hold a "
                          f"micro-batch under layout {opt}")
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
    if k.ilp_node_limit < 0 or k.ilp_time_limit_s <= 0:
        raise ConfigError(f"system.sim.ilp_node_limit ({k.ilp_node_limit}) must be >= 0 and ilp_time_limit_s "
                          f"({k.ilp_time_limit_s}) > 0")
    if system.cfg.opt_layout:
        dp, tp, pp = system.cfg.opt_layout
        if dp * tp * pp != wl.num_gpus:
            raise ConfigError(f"system.opt_layout: {list(system.cfg.opt_layout)} uses {dp * tp * pp} GPUs, not "
                              f"workload.num_gpus {wl.num_gpus}")
    cost_spec(system)


def simulate(system, wl, hw, seed: int) -> tuple[dict, dict]:
    env = Env(wl, hw, system, cost_spec(system), load_cost_data())
    cfg, policy = system.cfg, system.cfg.policy
    sample = step_batches(wl, seed + 1, cfg.sim.sample_steps)
    batches = step_batches(wl, seed, wl.steps)
    info: dict = {"num_gpus": wl.num_gpus, "context": wl.context, "token_budget": wl.token_budget,
                  "dataset": wl.dataset, "model": wl.model.name}
    prices: list[StepPrice] = []
    mega_r, mega_dp, grid = megatron_grid(env, sample)
    info["megatron_layout"] = f"({mega_dp},{mega_r.tp},{mega_r.pp})"
    if policy == "megatron_like":
        info["grid_search_step_s"] = grid
        prices = [price_homo_greedy(env, mega_r, mega_dp, b.lengths.tolist(), wl.context) for b in batches]
    elif policy == "deepspeed_like":
        r, gather_ms, zero, scores = deepspeed_grid(env, sample)
        info.update(deepspeed_layout=f"zero{zero} sp{r.tp} dp{env.n // r.tp}", grid_search_step_s=scores)
        prices = [price_deepspeed(env, r, gather_ms, zero, b.lengths.tolist()) for b in batches]
    else:
        opt = OptLayout(*cfg.opt_layout) if cfg.opt_layout else OptLayout(mega_dp, mega_r.tp, mega_r.pp)
        pool, strategies, mem = build_pool(env, sample, opt)
        info.update(opt_layout=str(opt), pool=pool.describe(), pool_raw_lists=pool.raw_lists,
                    strategies={r.label(): {"a": r.a, "b": r.b, "c": r.c, "cap": r.cap, "util": r.util}
                                for r in strategies})
        kw = env.plan_kwargs(seed)
        if policy == "hotspa_like":
            bounds = hotspa_boundaries(env)
            info["hotspa_boundaries"] = bounds
            prices = [price_hotspa(env, strategies, bounds, b.lengths.tolist()) for b in batches]
        elif policy in HOMO_MODES:
            prices = [price_homo_mode(env, policy, pool.candidates[0][0], opt.dp, b.lengths.tolist()) for b in batches]
        elif policy == "hydraulis_greedy_dynamic":
            prices = [price_greedy_dynamic(env, pool.candidates, b.lengths.tolist(), seed) for b in batches]
        else:
            cands = pool.candidates
            rule = "token_balanced" if policy == "hydraulis_token_balanced" else "greedy"
            if policy == "hydraulis_homo":
                cands = [pool.candidates[0]]
            elif policy == "hydraulis_static_hetero":
                cands = [static_choice(pool.candidates, sample, kw)]
                info["static_candidate"] = fmt_strategy(cands[0])
            fallback = 0
            for b in batches:
                ls = b.lengths.tolist()
                try:
                    plan = plan_step(ls, cands, dispatch_rule=rule, **kw)
                except ConfigError:
                    if policy != "hydraulis_static_hetero":
                        raise
                    fallback += 1  # the static list leaves a replica empty: this step runs the layout
                    plan = plan_step(ls, [pool.candidates[0]], **kw)
                prices.append(price_plan(env, ls, plan))
                peak = max(mem.bytes_at(rp.replica.tp, rp.replica.pp, sum(ls[i] for i in mb))
                           for rp in plan.replicas for mb in rp.micro_batches)
                info["peak_memory_gib"] = max(info.get("peak_memory_gib", 0.0), peak / GIB)
            if policy == "hydraulis_static_hetero":
                info["static_fallback_steps"] = fallback
        info["memory_limit_gib"] = (mem.mem_bytes - mem.safe_bytes) / GIB
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
    }
    if any(p.plan_time_s for p in prices):
        m["plan_time_s"] = Metric.from_samples([p.plan_time_s for p in prices], "s")
        m["plan_to_step_ratio"] = Metric.scalar(max(p.plan_time_s / p.step_s for p in prices), "ratio")
    status = Counter()
    for p in prices:
        status.update(p.statuses or {})
    if status:
        info["ilp_status_counts"] = dict(status)
        m["ilp_limit_fraction"] = Metric.scalar(status.get("limit", 0) / sum(status.values()), "ratio")
    info["winner_per_step"] = [p.candidate for p in prices]
    info["winner_counts"] = dict(Counter(p.candidate for p in prices))
    info["steps"] = wl.steps
    return m, info


def static_choice(pool, sample, kw) -> list:
    """Static-hetero ablation: the candidate the full planner picks most often on the sample
    steps (ties: the earlier in the pool), then used for every step."""
    wins = Counter(plan_step(b.lengths.tolist(), pool, **kw).candidate for b in sample)
    return pool[min(wins, key=lambda i: (-wins[i], i))]


def run_sim(system, job) -> RunResult:
    metrics, info = simulate(system, job.workload, job.hardware, job.seed)
    return RunResult(metrics=metrics, info=info)
