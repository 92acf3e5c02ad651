"""Hydraulis' policies and the baselines it runs, as registered components picked by
``system.policy`` (:data:`POLICIES`): a policy says which modes it runs and, in sim, how it prices
the job's steps (``prices(env, run)``, on the pricing of :mod:`impl.hydraulis.sim`); a real-mode
policy names its CPU-experiment run (batching and candidate pool of replica kinds, README "Real mode").

| policy                     | strategy per step                  | data assignment                      | modes |
|----------------------------|------------------------------------|--------------------------------------|-------|
| hydraulis (mode 4)         | best of the generator's pool        | min-max dispatch + ILP packing       | sim   |
| hydraulis_pad (mode 0)     | optimizer-layout (homogeneous)      | equal counts, pad to the step's max  | sim   |
| hydraulis_equal (mode 1)   | optimizer-layout                    | equal-count packing                  | sim   |
| hydraulis_greedy_static (2)| optimizer-layout                    | greedy packing, padded to capacity   | sim   |
| hydraulis_greedy_dynamic(3)| best of the pool                    | min-max dispatch + greedy packing    | sim   |
| hydraulis_homo             | optimizer-layout only (ablation)    | min-max dispatch + ILP packing       | sim   |
| hydraulis_token_balanced   | best of the pool (ablation)         | token-balanced dispatch + ILP        | sim   |
| hydraulis_static_hetero    | one pool candidate for every step   | min-max dispatch + ILP packing       | sim   |
| megatron_like              | grid-searched homogeneous (tp,pp,dp)| greedy packing to the context        | sim   |
| megatron_grid_like         | HotSPa grid rule (dp,tp,pp,mbs) on the calibrated step model | the fork's packing | sim |
| deepspeed_like             | ZeRO-1/3 + Ulysses SP, grid-searched| greedy packing                       | sim   |
| hotspa_like                | one homogeneous strategy per bucket | HotSPa packing, hot switching        | sim   |
| hydraulis_h / _b0 / _b1    | the CPU experiment's runs           | two-stage / greedy / two-stage       | real  |

The static and grid-rule baselines and HotSPa-like bucketing are :mod:`impl.common.baselines`
(HotSPa runs them too); the functions here hand them Hydraulis' pricing.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional

from impl.common.errors import ConfigError
from impl.common.registry import Registry

from impl.hydraulis.cost.step import StepPrice
from impl.hydraulis.cost.strategy import GIB, fmt_strategy
from impl.hydraulis.sim import (PoolRun, SimEnv, SimRun, price_groups, deepspeed_grid, hotspa_boundaries, hotspa_plan,
                                megatron_grid_prices, pool_run, price_deepspeed, price_equal, price_greedy_dynamic,
                                price_greedy_static, price_homo_greedy, price_pad, price_planned, static_choice)


@dataclass(frozen=True)
class HydraulisPolicy(abc.ABC):
    """A policy: the modes it runs and, per mode, what it runs there."""

    name: str
    modes: tuple = ("sim",)
    # the harness's per-iteration terms (optimizer step, host overhead) added to every step;
    # False where the baseline's own step model already prices them in its iteration
    adds_iteration_overhead: bool = True

    @abc.abstractmethod
    def prices(self, env: SimEnv, run: SimRun) -> list[StepPrice]:
        """The per-step prices of this policy on the job's batches (sim mode)."""


POLICIES: Registry[HydraulisPolicy] = Registry("policy")


@dataclass(frozen=True)
class MegatronLike(HydraulisPolicy):
    def prices(self, env, run):
        run.info["grid_search_step_s"] = run.grid
        return [price_homo_greedy(env, run.mega_r, run.mega_dp, b.lengths.tolist(), env.wl.context) for b in run.batches]


@dataclass(frozen=True)
class MegatronGridLike(HydraulisPolicy):
    adds_iteration_overhead: bool = False

    def prices(self, env, run):
        prices, ginfo = megatron_grid_prices(env, run.sample, run.batches)
        run.info.update(ginfo)
        return prices


@dataclass(frozen=True)
class DeepSpeedLike(HydraulisPolicy):
    def prices(self, env, run):
        r, gather_ms, zero, scores = deepspeed_grid(env, run.sample)
        run.info.update(deepspeed_layout=f"zero{zero} sp{r.tp} dp{env.n // r.tp}", grid_search_step_s=scores)
        return [price_deepspeed(env, r, gather_ms, zero, b.lengths.tolist()) for b in run.batches]


@dataclass(frozen=True)
class PoolPolicy(HydraulisPolicy):
    """A policy on the optimizer layout and the candidate pool (the Hydraulis engine)."""

    def prices(self, env, run):
        pr = pool_run(env, run)
        prices = self.pool_prices(env, run, pr)
        run.info["memory_limit_gib"] = pr.mem.capacity_bytes / GIB
        return prices

    @abc.abstractmethod
    def pool_prices(self, env: SimEnv, run: SimRun, pr: PoolRun) -> list[StepPrice]:
        """The per-step prices on the prepared optimizer layout and pool."""


@dataclass(frozen=True)
class HotSPaLike(PoolPolicy):
    def pool_prices(self, env, run, pr):
        bounds, strat = hotspa_plan(env, pr.strategies, hotspa_boundaries(env), run.sample)
        run.info.update(hotspa_boundaries=bounds, hotspa_strategies=[fmt_strategy([r]) for r in strat])
        return [price_groups(env, bounds, strat, b.lengths.tolist()) for b in run.batches]


@dataclass(frozen=True)
class Homogeneous(PoolPolicy):
    """Modes 0-2: the optimizer-layout strategy for every step, the mode's packing."""

    price: Optional[Callable] = None

    def pool_prices(self, env, run, pr):
        return [self.price(env, pr.pool.candidates[0][0], pr.opt.dp, b.lengths.tolist()) for b in run.batches]


@dataclass(frozen=True)
class GreedyDynamic(PoolPolicy):
    def pool_prices(self, env, run, pr):
        return [price_greedy_dynamic(env, pr.pool.candidates, b.lengths.tolist(), run.seed) for b in run.batches]


@dataclass(frozen=True)
class Planned(PoolPolicy):
    """The full planner on every candidate of the pool, dispatching by ``rule``."""

    rule: str = "greedy"

    def __post_init__(self):
        if self.rule not in ("greedy", "token_balanced"):
            raise ConfigError(f"system.policy {self.name}: unknown dispatch rule {self.rule!r} (greedy, token_balanced)")

    def pool_prices(self, env, run, pr):
        return price_planned(env, run, pr, pr.pool.candidates, self.rule)


@dataclass(frozen=True)
class PlannedOnLayout(Planned):
    """The full planner on the optimizer layout alone (the homogeneous ablation)."""

    def pool_prices(self, env, run, pr):
        return price_planned(env, run, pr, [pr.pool.candidates[0]], self.rule)


@dataclass(frozen=True)
class PlannedStatic(Planned):
    """The full planner on one candidate for every step: the one it picks most on the sample."""

    def pool_prices(self, env, run, pr):
        cands = [static_choice(pr.pool.candidates, run.sample, pr.kw)]
        run.info["static_candidate"] = fmt_strategy(cands[0])
        # the static list may leave a replica empty on a step: that step runs the layout
        return price_planned(env, run, pr, cands, self.rule, fallback=[pr.pool.candidates[0]])


@dataclass(frozen=True)
class RealRunPolicy(HydraulisPolicy):
    """A run of the CPU experiment (README "Real mode"): batching and candidate pool of replica kinds."""

    modes: tuple = ("real",)
    batching: str = "two_stage"
    pool: tuple = ()

    def prices(self, env, run):
        # The system refuses a real-only policy in sim mode before any pricing (Hydraulis.check).
        raise ConfigError(f"system.policy: {self.name} runs in real mode only (one of the sim policies: "
                          f"{', '.join(in_mode('sim'))})")


for _p in (Planned("hydraulis"),
           Homogeneous("hydraulis_pad", price=price_pad),
           Homogeneous("hydraulis_equal", price=price_equal),
           Homogeneous("hydraulis_greedy_static", price=price_greedy_static),
           GreedyDynamic("hydraulis_greedy_dynamic"),
           PlannedOnLayout("hydraulis_homo"),
           Planned("hydraulis_token_balanced", rule="token_balanced"),
           PlannedStatic("hydraulis_static_hetero"),
           MegatronLike("megatron_like"),
           MegatronGridLike("megatron_grid_like"),
           DeepSpeedLike("deepspeed_like"),
           HotSPaLike("hotspa_like"),
           RealRunPolicy("hydraulis_h", batching="two_stage", pool=(("A", "B"),)),
           RealRunPolicy("hydraulis_b0", batching="greedy", pool=(("A", "A"),)),
           RealRunPolicy("hydraulis_b1", batching="two_stage", pool=(("A", "A"),))):
    POLICIES.add(_p.name, _p)


def in_mode(mode: str) -> tuple[str, ...]:
    """The policies that run ``mode``."""
    return tuple(n for n, p in POLICIES.items() if mode in p.modes)
