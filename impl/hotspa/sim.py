"""HotSPa sim mode (the paper-scale simulation, impl/hotspa/README.md): per step, draw ``global_batch_seqs`` lengths, then
- hotspa: group by the boundaries, pack (the authors' packing rule), assign to DP ranks, price each group under its
  strategy, add the switches of the authors' schedule (planner policy ``system.switch_policy``),
  the DP gradient reductions, ZeRO-1 and the update in the home layout;
- hotspa_static: the same engine with the home strategy only (one group, no switching);
- megatron_static / deepspeed_static: the grid-searched best single strategy (TP, or Ulysses
  SP) that fits the context, greedy packing, 1F1B, ZeRO-1 (our baseline setup, impl/hotspa/README.md "Reconstructed choices").
- megatron_grid: the authors' grid rule (:mod:`impl.common.baselines.megatron_grid`).
Seeded and deterministic: the same config gives the same metrics bit for bit. Prices come from
:mod:`impl.hotspa.cost`; our planner is :mod:`impl.hotspa.planner`. What differs per policy is
its component's hooks (:mod:`impl.hotspa.policies`); this module holds what they share.
"""
from __future__ import annotations

import dataclasses

from impl.common.api import ConfigError, Metric, RunResult
from impl.common.baselines.megatron_grid import GridRule, GridRuleConfig
from impl.common.baselines.static import StaticGridConfig
from impl.common.parallel.migration import POLICIES as SWITCH_POLICIES
from impl.common.varlen.sampling import LengthStream

from impl.hotspa.planner import plan_groups
from impl.hotspa.presets import PRESET_GROUPINGS, load_presets
from impl.hotspa.cost import PricingEnv, best_static, check_fits, price_grouped_step, price_static_step
from impl.hotspa.strategy import GroupPlan, make_group_plan, parse_strategy


def at_context(wl, context: int):
    """The workload at another context: its lengths re-clipped to it."""
    return dataclasses.replace(wl, context=int(context),
                               lengths=dataclasses.replace(wl.lengths, max_len=int(context)))


def _batches(wl, seed: int, steps: int):
    stream = LengthStream(wl.lengths, seed)
    if wl.token_budget > 0:
        return [stream.by_tokens(wl.token_budget) for _ in range(steps)]
    return [stream.by_count(wl.global_batch_seqs) for _ in range(steps)]


def group_plan(system, env: PricingEnv, wl, seed: int, home_only: bool = False) -> tuple[GroupPlan, dict]:
    """The boundaries and strategies a HotSPa-engine policy runs at ``wl.context`` (``home_only``:
    the home strategy for every sequence, one group)."""
    cfg, info = system.cfg, {}
    if cfg.grouping in PRESET_GROUPINGS:
        gp = load_presets().group_plan(cfg.grouping, wl.model.name, wl.num_gpus, wl.context)
    elif cfg.grouping == "explicit":
        gp = make_group_plan(cfg.boundaries, cfg.strategies, wl.num_gpus)
        if gp.boundaries[0] < wl.context:
            raise ConfigError(f"system.boundaries: top boundary {gp.boundaries[0]} is below workload.context "
                              f"{wl.context}")
    else:
        k = cfg.sim
        planned = plan_groups(env, _batches(wl, seed + 1, k.plan_sample_steps), wl.context,
                              candidates=k.plan_candidates, max_groups=k.plan_max_groups, max_tp=8,
                              pad=cfg.pad, align=cfg.align, policy=cfg.switch_policy)
        gp = planned.plan
        info["planner_candidates_tried"] = planned.candidates_tried
    check_fits(env, gp)
    if home_only:
        gp = GroupPlan((gp.boundaries[0], 0), (gp.home,))
    return gp, info


def check_sim(system, wl, hardware) -> None:
    cfg, policy = system.cfg, system.component
    if "bf16" not in hardware.peak_flops:
        raise ConfigError(f"hardware {hardware.name}: sim mode prices bf16 compute, which the profile lacks")
    for p in cfg.sim.report_policies:
        if p not in SWITCH_POLICIES:
            raise ConfigError(f"system.sim.report_policies: unknown {p!r} (one of: {', '.join(SWITCH_POLICIES)})")
    for c in cfg.sim.contexts:
        if c < 1 or c % cfg.align:
            raise ConfigError(f"system.sim.contexts: {c} must be a positive multiple of system.align {cfg.align}")
    StaticGridConfig(max_tp=cfg.sim.static_max_tp)  # refuses a bad system.sim.static_max_tp in one line
    if cfg.sim.plan_max_groups < 1 or cfg.sim.plan_sample_steps < 1:
        raise ConfigError(f"system.sim.plan_max_groups ({cfg.sim.plan_max_groups}) and plan_sample_steps "
                          f"({cfg.sim.plan_sample_steps}) must be >= 1")
    policy.check_sim(system, wl)
    if wl.lengths.max_len and wl.lengths.max_len > wl.context:
        raise ConfigError(f"workload.lengths.max_len: {wl.lengths.max_len} is above workload.context {wl.context}")
    for ctx in [wl.context, *cfg.sim.contexts]:
        w = wl if ctx == wl.context else at_context(wl, ctx)
        policy.check_context(system, PricingEnv(w, hardware, cfg.sim), w)


def simulate(system, wl, hardware, seed: int) -> tuple[dict[str, Metric], dict]:
    """Metrics and info of one (system, workload) case."""
    env = PricingEnv(wl, hardware, system.cfg.sim)
    batches = _batches(wl, seed, wl.steps)
    info: dict = {"context": wl.context, "num_gpus": wl.num_gpus, "dataset": wl.dataset}
    return system.component.simulate(system, env, wl, hardware, seed, batches, info)


def simulate_grouped(system, env: PricingEnv, wl, seed: int, batches, info: dict, home_only: bool
                     ) -> tuple[dict[str, Metric], dict]:
    """HotSPa's engine: the group plan, every step grouped, packed and switched."""
    cfg = system.cfg
    pad = {"align": "align", "bound": "bound"}[cfg.pad]
    gp, extra = group_plan(system, env, wl, seed, home_only)
    info.update(extra)
    info["boundaries"] = list(gp.boundaries)
    info["strategies"] = [str(s) for s in gp.strategies]
    info["maxlen"] = [env.maxlen(s) for s in gp.strategies]
    prices = [price_grouped_step(env, b.ids, b.lengths, gp, pad=pad, align=cfg.align, policy=cfg.switch_policy,
                                 fused=cfg.sim.buffer_fusion, replicas=cfg.sim.replicas,
                                 report_policies=cfg.sim.report_policies) for b in batches]
    return engine_metrics(system, env, prices, info)


def simulate_static(system, env: PricingEnv, wl, seed: int, batches, info: dict, parallel: str
                    ) -> tuple[dict[str, Metric], dict]:
    """A static baseline (:mod:`impl.common.baselines.static`): one strategy, TP or Ulysses SP,
    grid-searched (or ``system.sim.static_strategy``), greedy packing to the context."""
    cfg = system.cfg
    grid = StaticGridConfig(parallel=parallel, max_tp=cfg.sim.static_max_tp)
    plan_batches = _batches(wl, seed + 1, cfg.sim.plan_sample_steps)
    if cfg.sim.static_strategy:
        best = parse_strategy(cfg.sim.static_strategy, wl.num_gpus, "system.sim.static_strategy")
        if env.maxlen(best, parallel) < wl.context:
            raise ConfigError(f"system.sim.static_strategy: {best} fits micro-batches of at most "
                              f"{env.maxlen(best, parallel)} tokens, below workload.context {wl.context}")
        scores = {}
    else:
        best, scores = best_static(env, plan_batches, wl.context, grid=grid, pad="align", align=cfg.align)
    info.update(boundaries=[wl.context, 0], strategies=[str(best)], parallel=parallel,
                maxlen=[env.maxlen(best, parallel)], grid_search_step_s=scores)
    prices = [price_static_step(env, b.ids, b.lengths, best, wl.context, pad="align", align=cfg.align,
                                parallel=parallel) for b in batches]
    return engine_metrics(system, env, prices, info)


def engine_metrics(system, env: PricingEnv, prices, info: dict) -> tuple[dict[str, Metric], dict]:
    cfg = system.cfg
    steps = [p.step_s for p in prices]
    tokens = sum(p.tokens for p in prices)
    m = {
        "step_time_s": Metric.from_samples(steps, "s"),
        "switch_time_s": Metric.from_samples([p.switch_s for p in prices], "s"),
        "compute_time_s": Metric.from_samples([p.compute_s for p in prices], "s"),
        "dp_sync_time_s": Metric.from_samples([p.dp_sync_s for p in prices], "s"),
        "throughput_tokens_per_s": Metric.scalar(tokens / sum(steps), "tokens/s", "higher"),
        "switch_fraction": Metric.scalar(sum(p.switch_s for p in prices) / sum(steps), "ratio"),
        "peak_memory_gib": Metric.scalar(max(p.peak_memory_bytes for p in prices) / 2**30, "GiB"),
    }
    for pol in cfg.sim.report_policies:
        m[f"switch_time_s@{pol}"] = Metric.from_samples([p.switch_by_policy[pol] for p in prices], "s")
    info["group_compute_s_step0"] = [round(t, 6) for t in prices[0].group_compute_s]
    info["group_micro_batches_step0"] = prices[0].group_micro_batches
    info["schedule_step0"] = prices[0].order
    info["memory_capacity_gib"] = env.mem.capacity_bytes / 2**30
    return m, info


def simulate_grid(wl, hardware, seed: int, batches, info: dict) -> tuple[dict[str, Metric], dict]:
    """The authors' grid-rule Megatron baseline on the step model
    (:mod:`impl.common.baselines.megatron_grid`): steps of a fixed sequence count, the fork's
    global batch as is, two planning steps."""
    rule = GridRule(GridRuleConfig(token_budget_steps=False), wl, hardware)
    best, ginfo = rule.search(_batches(wl, seed + 1, 2))
    ests = rule.estimates(best, batches)
    steps = [e.iteration_s for e in ests]
    tokens = sum(int(sum(int(x) for x in b.lengths)) for b in batches)
    info.update(strategies=[str(best)], boundaries=[wl.context, 0], megatron_step_model=True, **ginfo,
                fits_every_step=all(e.fits for e in ests), breakdown_step0=ests[0].breakdown_s)
    zero = Metric.from_samples([0.0] * len(steps), "s")
    m = {"step_time_s": Metric.from_samples(steps, "s"), "switch_time_s": zero,
         "compute_time_s": Metric.from_samples(steps, "s"), "dp_sync_time_s": zero,
         "throughput_tokens_per_s": Metric.scalar(tokens / sum(steps), "tokens/s", "higher"),
         "switch_fraction": Metric.scalar(0.0, "ratio"),
         "peak_memory_gib": Metric.scalar(max(e.max_peak_allocated_bytes for e in ests) / 2**30, "GiB")}
    return m, info


def run_sim(system, job) -> RunResult:
    wl = job.workload
    metrics, info = simulate(system, wl, job.hardware, job.seed)
    per_ctx = {}
    for ctx in system.cfg.sim.contexts:
        m, i = simulate(system, at_context(wl, ctx), job.hardware, job.seed)
        for name in ("step_time_s", "switch_time_s", "throughput_tokens_per_s", "peak_memory_gib"):
            metrics[f"{name}@ctx{ctx}"] = m[name]
        for pol in system.cfg.sim.report_policies:
            metrics[f"switch_time_s@{pol}@ctx{ctx}"] = m[f"switch_time_s@{pol}"]
        per_ctx[str(ctx)] = {"strategies": i["strategies"], "boundaries": i["boundaries"]}
    if per_ctx:
        info["contexts"] = per_ctx
    info["steps"] = wl.steps
    return RunResult(metrics=metrics, info=info)
