"""HotSPa and its baselines as harness systems (one class, the policy chosen by a knob).

| system            | strategy per step                                              | modes     |
|-------------------|----------------------------------------------------------------|-----------|
| hotspa            | one strategy per length group, hot switching inside the step   | sim, real |
| hotspa_static     | HotSPa's engine with the home strategy only (no switching)      | sim, real |
| megatron_static   | best single (dp,tp,pp) that fits the context, greedy packing    | sim, real |
| deepspeed_static  | as megatron_static with Ulysses SP instead of TP               | sim       |
| megatron_grid     | the authors' grid rule (tp across nodes, mbs 1-32, the fork's   | sim       |
|                   | packing) on the Megatron step model, fitting layouts only       |           |

Real mode lives in :mod:`impl.hotspa.real`, sim mode in :mod:`impl.hotspa.sim`; the knobs only
one mode reads sit in the nested ``real`` / ``sim`` nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from impl.common.api import ConfigError, JobContext, RunResult, System

from impl.hotspa.presets import PRESET_GROUPINGS
from impl.hotspa.real_config import HotSPaRealKnobs
from impl.hotspa.sim_config import HotSPaSimKnobs

POLICIES = ("hotspa", "hotspa_static", "megatron_static", "deepspeed_static", "megatron_grid")
SWITCH_POLICIES = ("bandwidth_greedy", "greedy_msgs", "node_aware_rr", "round_robin", "fcfs")
GROUPINGS = (*PRESET_GROUPINGS, "planned", "explicit")


class HotSPa(System):
    @dataclass
    class Config:
        policy: str = "hotspa"
        # c1 / c2: the authors' preset groups with their preset strategies (`examples/hotspa`);
        # planned: boundaries and strategies from the length histogram (our planner);
        # explicit: ``boundaries`` and ``strategies`` below.
        grouping: str = "c1"
        boundaries: List[int] = field(default_factory=list)  # descending, last 0 (explicit)
        strategies: List[List[int]] = field(default_factory=list)  # [dp, tp, pp] per group, longest first
        switch_policy: str = "bandwidth_greedy"
        # Packing pad (both options of the authors' code): "align" pads a packed row to a multiple of ``align``;
        # "bound" pads to the group's upper bound (static shapes).
        pad: str = "align"
        align: int = 128
        real: HotSPaRealKnobs = field(default_factory=HotSPaRealKnobs)
        sim: HotSPaSimKnobs = field(default_factory=HotSPaSimKnobs)

    def __init__(self, cfg, name):
        super().__init__(cfg, name)
        for fld, allowed in (("policy", POLICIES), ("switch_policy", SWITCH_POLICIES),
                             ("grouping", GROUPINGS), ("pad", ("align", "bound"))):
            if getattr(cfg, fld) not in allowed:
                raise ConfigError(f"system.{fld}: unknown value {getattr(cfg, fld)!r} (one of: {', '.join(allowed)})")
        if cfg.align < 1:
            raise ConfigError(f"system.align: must be >= 1, got {cfg.align}")
        if cfg.grouping == "explicit" and not cfg.boundaries:
            raise ConfigError("system.boundaries: grouping 'explicit' needs a descending boundary list")

    @property
    def modes(self):  # type: ignore[override]
        return ("sim",) if self.cfg.policy in ("deepspeed_static", "megatron_grid") else ("sim", "real")

    def check(self, mode, wl, hardware, fault) -> None:
        self.require_workload(wl, "varlen")
        self.require_no_fault(fault)
        wl.validate()
        if mode == "real":
            from impl.hotspa.real import check_real

            check_real(self, wl, hardware)
        else:
            from impl.hotspa.sim import check_sim

            check_sim(self, wl, hardware)

    rank0_builder = True

    def check_rank0(self, wl, hardware, fault) -> None:
        self.require_workload(wl, "varlen")
        self.require_no_fault(fault)
        wl.validate()
        from impl.hotspa.estimate import check_rank0

        check_rank0(self, wl, hardware)

    def run(self, job: JobContext) -> RunResult:
        if job.mode == "real" and job.execution.ranks != "all":
            from impl.hotspa.estimate import run_rank0_job

            return run_rank0_job(self, job)
        if job.mode == "real":
            from impl.hotspa.real import run_real

            return run_real(self, job)
        from impl.hotspa.sim import run_sim

        return run_sim(self, job)
