"""HotSPa and its baselines as harness systems (one class, the policy chosen by a knob; the
policies are the components of :mod:`impl.hotspa.policies`).

Real mode lives in :mod:`impl.hotspa.real`, sim mode in :mod:`impl.hotspa.sim`; the knobs only
one mode reads sit in the nested ``real`` / ``sim`` nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from impl.common.api import ConfigError, JobContext, RunResult, System

from impl.hotspa.policies import POLICIES, HotSPaPolicy
from impl.hotspa.presets import PRESET_GROUPINGS
from impl.hotspa.real_config import HotSPaRealKnobs
from impl.hotspa.sim import SWITCH_POLICIES
from impl.hotspa.sim_config import HotSPaSimKnobs

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

        def __post_init__(self):
            for fld, allowed in (("policy", POLICIES.names()), ("switch_policy", SWITCH_POLICIES),
                                 ("grouping", GROUPINGS), ("pad", ("align", "bound"))):
                if getattr(self, fld) not in allowed:
                    raise ConfigError(f"system.{fld}: unknown value {getattr(self, fld)!r} (one of: {', '.join(allowed)})")
            if self.align < 1:
                raise ConfigError(f"system.align: must be >= 1, got {self.align}")
            if self.grouping == "explicit" and not self.boundaries:
                raise ConfigError("system.boundaries: grouping 'explicit' needs a descending boundary list")


    @property
    def component(self) -> HotSPaPolicy:
        return POLICIES.get(self.cfg.policy)

    @property
    def modes(self):  # type: ignore[override]
        return self.component.modes

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
