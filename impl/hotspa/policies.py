"""HotSPa's policies and the baselines it runs, as registered components picked by ``system.policy``
(:data:`POLICIES`): the modes a policy runs, its sim-mode hooks (checks, the job's simulation on
:mod:`impl.hotspa.sim`) and what real mode runs for it.

| policy            | strategy per step                                              | modes     |
|-------------------|----------------------------------------------------------------|-----------|
| hotspa            | one strategy per length group, hot switching inside the step   | sim, real |
| hotspa_static     | HotSPa's engine with the home strategy only (no switching)      | sim, real |
| megatron_static   | best single (dp,tp,pp) that fits the context, greedy packing    | sim, real |
| deepspeed_static  | as megatron_static with Ulysses SP instead of TP               | sim       |
| megatron_grid     | the authors' grid rule (tp across nodes, mbs 1-32, the fork's   | sim       |
|                   | packing) on the Megatron step model, fitting layouts only       |           |

In real mode hotspa_static and megatron_static run the same thing: the home strategy for every
sequence (the static TP2 baseline of the real CPU experiment). The static and grid-rule baselines
are :mod:`impl.common.baselines` (Hydraulis runs them too).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

from impl.common.errors import ConfigError
from impl.common.registry import Registry

from impl.hotspa.sim import group_plan, simulate_grid, simulate_grouped, simulate_static


@dataclass(frozen=True)
class HotSPaPolicy(abc.ABC):
    name: str
    modes: tuple = ("sim", "real")
    # real mode: the home strategy for every sequence instead of the group plan
    real_home_only: bool = False

    def check_sim(self, system, wl) -> None:
        """Sim-mode limits of this policy (beyond the shared ones)."""

    def check_context(self, system, env, wl) -> None:
        """Sim-mode limits at one context (``wl`` clipped to it)."""

    @abc.abstractmethod
    def simulate(self, system, env, wl, hardware, seed: int, batches, info: dict):
        """Sim mode: the per-step prices of this policy on the job's batches."""


POLICIES: Registry[HotSPaPolicy] = Registry("policy")


@dataclass(frozen=True)
class Grouped(HotSPaPolicy):
    """HotSPa's engine on the group plan (``home_only``: its home strategy alone)."""

    home_only: bool = False

    def check_context(self, system, env, wl) -> None:
        if system.cfg.grouping != "planned":  # planned needs the sampled histogram: checked when run
            group_plan(system, env, wl, 0, self.home_only)

    def simulate(self, system, env, wl, hardware, seed, batches, info):
        return simulate_grouped(system, env, wl, seed, batches, info, self.home_only)


@dataclass(frozen=True)
class Static(HotSPaPolicy):
    parallel: str = "tp"

    def check_sim(self, system, wl) -> None:
        if self.parallel == "ulysses" and not system.cfg.sim.sequence_parallel:
            raise ConfigError(f"system.sim.sequence_parallel: false means Megatron TP without SP; {self.name} "
                              "splits activations with Ulysses SP, so it has no such variant")

    def simulate(self, system, env, wl, hardware, seed, batches, info):
        return simulate_static(system, env, wl, seed, batches, info, self.parallel)


@dataclass(frozen=True)
class GridRulePolicy(HotSPaPolicy):
    modes: tuple = ("sim",)

    def check_sim(self, system, wl) -> None:
        if wl.token_budget > 0:
            raise ConfigError(f"workload.token_budget: system {system.name!r} takes a global batch of a fixed number "
                              f"of sequences (the fork's), not a budget of {wl.token_budget} tokens per step")

    def simulate(self, system, env, wl, hardware, seed, batches, info):
        return simulate_grid(wl, hardware, seed, batches, info)


for _p in (Grouped("hotspa"),
           Grouped("hotspa_static", home_only=True, real_home_only=True),
           Static("megatron_static", parallel="tp", real_home_only=True),
           Static("deepspeed_static", modes=("sim",), parallel="ulysses"),
           GridRulePolicy("megatron_grid")):
    POLICIES.add(_p.name, _p)


def in_mode(mode: str) -> tuple[str, ...]:
    """The policies that run ``mode``."""
    return tuple(n for n, p in POLICIES.items() if mode in p.modes)
