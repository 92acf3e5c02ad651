"""Falcon (Wu et al., arXiv 2410.12588) as ADAPTRA's DP-link straggler baseline.

* Detection: Bayesian online change-point detection on iteration time (impl.adaptra.detect;
  p 0.9, before/after means >= 10% apart). Which link is slow is taken as known once a change
  is kept: Falcon profiles per-group transfer times (> 1.1x the median = suspect); the
  simulator has no per-group noise to get that wrong, so it names the injected link.
* Mitigation (:class:`SkiRentalLadder`): ignore -> rebalance micro-batches -> remap topology ->
  checkpoint-restart. From the change point on, the slowdown (iteration time - before mean)
  accumulates; when it reaches the next action's one-time cost the ladder takes that action
  (at the next iteration boundary) and starts accumulating afresh (ski rental).
* Effects on a slow DP link (our harness [R]): rebalancing micro-batches between replicas
  changes nothing (the all-reduce gates both replicas alike); remap turns the slow DP link
  into a pipeline link (impl.adaptra.mitigate.remap_link) and keeps running ZB, GPU-direct;
  restart excludes the bad link.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from impl.adaptra.detect import HAZARD, MIN_REL_CHANGE, THRESHOLD, ChangeDetector
from impl.adaptra.mitigate import DpMitigation
from impl.adaptra.policies import COMMS
from impl.adaptra.system import PipelineTraining
from impl.common.api import ConfigError

LADDER = ("ignore", "rebalance", "remap", "restart")


class SkiRentalLadder:
    """ignore -> rebalance -> remap -> restart; escalate when the slowdown accumulated since
    the last step reaches the next action's cost (Falcon's ski-rental rule)."""

    def __init__(self, costs_s: dict):
        missing = [a for a in LADDER[1:] if a not in costs_s]
        if missing:
            raise ConfigError(f"ladder: no cost for action(s) {', '.join(missing)}")
        bad = {a: c for a, c in costs_s.items() if not c >= 0}
        if bad:
            raise ConfigError(f"ladder: action costs must be >= 0 seconds, got {bad}")
        self.costs_s = dict(costs_s)
        self.level = 0
        self.accumulated_s = 0.0

    @property
    def action(self) -> str:
        return LADDER[self.level]

    def next_cost_s(self) -> Optional[float]:
        return self.costs_s[LADDER[self.level + 1]] if self.level + 1 < len(LADDER) else None

    def charge(self, slowdown_s: float) -> Optional[str]:
        """Add one iteration's slowdown; return the action to take now, if any."""
        self.accumulated_s += max(slowdown_s, 0.0)
        cost = self.next_cost_s()
        if cost is not None and self.accumulated_s >= cost:
            self.level += 1
            self.accumulated_s = 0.0
            return LADDER[self.level]
        return None


class FalconLadder(DpMitigation):
    name = "falcon_ladder"

    def __init__(self, costs_s: dict, **detector_kw):
        super().__init__()
        self.detector = ChangeDetector(**detector_kw)
        self.ladder = SkiRentalLadder(costs_s)
        self.base_s: Optional[float] = None
        self.decisions: list[dict] = []

    def observe(self, iteration: int, time_s: float, dp_delays: dict) -> None:
        change = self.detector.update(time_s)
        if self.base_s is None:
            if change is None or change.rel_change <= 0:
                return
            # Detection took a few iterations: charge the slowdown since the change point at once.
            self.base_s = change.before_mean
            self.in_force = "ignore"
            slowdown_s = sum(t - self.base_s for t in self.detector.series[change.at:])
        else:
            slowdown_s = time_s - self.base_s
        action = self.ladder.charge(slowdown_s)
        if action:
            cost = self.ladder.costs_s[action]
            self.decisions.append({"iteration": iteration, "action": action, "cost_s": cost})
            self._pending.append((action, cost, "ski rental: accumulated slowdown >= cost"))

    def info(self) -> dict:
        return {"policy": self.name, "changes": [c.__dict__ for c in self.detector.changes],
                "decisions": self.decisions, "costs_s": self.ladder.costs_s}


class Falcon(PipelineTraining):
    """ZB with Falcon's detector and mitigation ladder (DP-link stragglers only)."""

    modes = ("sim",)
    SUPPORTED_FAULTS = ("none", "dp_link_delay")

    @dataclass
    class Config(PipelineTraining.Config):
        schedule: str = "zb"
        comm: str = "in_stream"
        dp_link_policy: str = "ladder"
        hazard: float = HAZARD
        cp_threshold: float = THRESHOLD
        min_rel_change: float = MIN_REL_CHANGE
        # One-time cost of moving micro-batches between replicas [R]: a data-loader change.
        rebalance_cost_s: float = 1.0
        # its mitigation is the ladder (Falcon._mitigation)
        DP_POLICIES: ClassVar[tuple[str, ...]] = ("ladder",)

        def __post_init__(self):
            super().__post_init__()
            if COMMS.get(self.comm).delegated:
                raise ConfigError("system.comm: falcon runs ZB on GPU-direct P2P (in_stream, inline or latency), "
                                  "not 'delegated'")
            if not 0 < self.hazard < 1:
                raise ConfigError(f"system.hazard must be in (0, 1), got {self.hazard}")
            if not 0 < self.cp_threshold <= 1:
                raise ConfigError(f"system.cp_threshold must be in (0, 1], got {self.cp_threshold}")

    def _mitigation(self, job) -> DpMitigation:
        c = self.cfg
        return FalconLadder({"rebalance": c.rebalance_cost_s, "remap": c.remap_cost_s, "restart": c.restart_cost_s},
                            hazard=c.hazard, threshold=c.cp_threshold, min_rel_change=c.min_rel_change)
