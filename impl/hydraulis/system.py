"""Hydraulis and its baselines as harness systems (one class, the policy chosen by a knob; the
policies are the components of :mod:`impl.hydraulis.policies`).

Real mode (policies of the CPU experiment, README "Real mode") lives in :mod:`impl.hydraulis.real.run`; sim in
:mod:`impl.hydraulis.sim`. Knobs both modes' planner reads are top level; one-mode knobs sit in
the nested ``real`` / ``sim`` nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from impl.common.api import ConfigError, JobContext, RunResult, System

from impl.hydraulis.policies import POLICIES, HydraulisPolicy, in_mode
from impl.hydraulis.real.config import HydraulisRealKnobs
from impl.hydraulis.sim_config import HydraulisSimKnobs
from impl.hydraulis.step_plan import IlpScope

SIM_POLICIES = in_mode("sim")


class Hydraulis(System):
    @dataclass
    class Config:
        policy: str = "hydraulis"
        # Planner (the authors' new_dynamic.py): seeded dispatch shuffles (100; their artifact path
        # uses 50), the v window (16; artifact 20), the ILP limits and the c treatment (README
        # "Pitfall 8").
        shuffles: int = 100
        v_window: int = 16
        ilp_time_limit_s: float = 0.5
        mip_rel_gap: float = 0.01  # [R] HiGHS relative gap (README: 0 vs 0.01 on S3)
        dispatch_includes_c: bool = True
        # Besides the seeded shuffles (the authors' stream), two longest-first orders and a local
        # search (moves/swaps off the critical replica); False = the authors' dispatch alone. The
        # search stops after dispatch_budget scans (README: dispatch never worse than the authors').
        dispatch_refine: bool = True
        dispatch_budget: int = 100
        ilp_scope: IlpScope = IlpScope.critical
        # Optimizer layout [dp, tp, pp]; [] = the Megatron-like grid search's best layout.
        opt_layout: List[int] = field(default_factory=list)
        # Generator (impl/hydraulis/generator.py): heterogeneous lists kept, the length step (0 = 128, or 1024 for
        # models of hidden >= 6144) and the GPU step ΔN (0 = 1, or 4 from 256 GPUs).
        max_candidates: int = 6
        # Fixed candidate lists instead of the generator (as the authors' scripts give them), e.g.
        # ["(16,1)x4", "(16,1) + (8,1)x6"]; the first should be the optimizer layout. [] = generator.
        pool: List[str] = field(default_factory=list)
        # auto: the scripts' lists of impl/hydraulis/data/pools.yaml where one matches (model,
        # GPUs, memory class), else the generator; generator: always the generator.
        pool_source: str = "auto"
        generator_step: int = 0
        generator_delta_n: int = 0
        align: int = 128  # micro-batches padded to a multiple of this (the authors' 128)
        real: HydraulisRealKnobs = field(default_factory=HydraulisRealKnobs)
        sim: HydraulisSimKnobs = field(default_factory=HydraulisSimKnobs)

        def __post_init__(self):
            for fld, lo in (("shuffles", 1), ("v_window", 1), ("align", 1), ("max_candidates", 0),
                            ("dispatch_budget", 0), ("generator_step", 0), ("generator_delta_n", 0)):
                if getattr(self, fld) < lo:
                    raise ConfigError(f"system.{fld}: must be >= {lo}, got {getattr(self, fld)}")
            if self.ilp_scope not in ("critical", "all"):
                raise ConfigError(f"system.ilp_scope: unknown {self.ilp_scope!r} (one of: critical, all)")
            if self.ilp_time_limit_s <= 0:
                raise ConfigError(f"system.ilp_time_limit_s: must be > 0, got {self.ilp_time_limit_s}")
            if not 0 <= self.mip_rel_gap < 1:
                raise ConfigError(f"system.mip_rel_gap: must be in [0, 1), got {self.mip_rel_gap}")
            if self.opt_layout and (len(self.opt_layout) != 3 or min(self.opt_layout) < 1):
                raise ConfigError(f"system.opt_layout: need [dp, tp, pp] >= 1 each, got {list(self.opt_layout)}")
            POLICIES.get(self.policy)

    @property
    def component(self) -> HydraulisPolicy:
        return POLICIES.get(self.cfg.policy)

    @property
    def modes(self):  # type: ignore[override]
        return self.component.modes

    def check(self, mode, wl, hardware, fault) -> None:
        self.require_workload(wl, "varlen")
        self.require_no_fault(fault)
        wl.validate()
        if mode == "real":
            from impl.hydraulis.real.run import check_real

            check_real(self, wl, hardware)
        else:
            if "sim" not in self.component.modes:
                raise ConfigError(f"system.policy: {self.cfg.policy!r} is not a sim policy (one of: "
                                  f"{', '.join(SIM_POLICIES)})")
            from impl.hydraulis.sim import check_sim

            check_sim(self, wl, hardware)

    def run(self, job: JobContext) -> RunResult:
        if job.mode == "real":
            from impl.hydraulis.real.run import run_real

            return run_real(self, job)
        from impl.hydraulis.sim import run_sim

        return run_sim(self, job)
