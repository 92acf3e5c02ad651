"""Hydraulis and its baselines as harness systems (one class, the policy chosen by a knob).

| system                     | strategy per step                  | data assignment                      | modes |
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

Real mode (policies of the CPU experiment, README "Real mode") lives in :mod:`impl.hydraulis.real.run`; sim in
:mod:`impl.hydraulis.sim`. Knobs both modes' planner reads are top level; one-mode knobs sit in
the nested ``real`` / ``sim`` nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from impl.common.api import ConfigError, JobContext, RunResult, System

from impl.hydraulis.real.config import HydraulisRealKnobs
from impl.hydraulis.sim_config import HydraulisSimKnobs
from impl.hydraulis.step_plan import IlpScope

SIM_POLICIES = ("hydraulis", "hydraulis_pad", "hydraulis_equal", "hydraulis_greedy_static",
                "hydraulis_greedy_dynamic", "hydraulis_homo", "hydraulis_token_balanced",
                "hydraulis_static_hetero", "megatron_like", "megatron_grid_like", "deepspeed_like", "hotspa_like")


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
        # Issue 40: besides the seeded shuffles (the authors' stream), two longest-first
        # orders and a local search (moves/swaps off the critical replica); False = the authors'
        # dispatch alone. The search stops after dispatch_budget scans (README "Issue 40").
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

    def __init__(self, cfg, name):
        super().__init__(cfg, name)
        c = cfg
        for fld, lo in (("shuffles", 1), ("v_window", 1), ("align", 1), ("max_candidates", 0), ("dispatch_budget", 0),
                        ("generator_step", 0), ("generator_delta_n", 0)):
            if getattr(c, fld) < lo:
                raise ConfigError(f"system.{fld}: must be >= {lo}, got {getattr(c, fld)}")
        if c.ilp_scope not in ("critical", "all"):
            raise ConfigError(f"system.ilp_scope: unknown {c.ilp_scope!r} (one of: critical, all)")
        if c.ilp_time_limit_s <= 0:
            raise ConfigError(f"system.ilp_time_limit_s: must be > 0, got {c.ilp_time_limit_s}")
        if not 0 <= c.mip_rel_gap < 1:
            raise ConfigError(f"system.mip_rel_gap: must be in [0, 1), got {c.mip_rel_gap}")
        if c.opt_layout and (len(c.opt_layout) != 3 or min(c.opt_layout) < 1):
            raise ConfigError(f"system.opt_layout: need [dp, tp, pp] >= 1 each, got {list(c.opt_layout)}")

    @property
    def modes(self):  # type: ignore[override]
        return ("sim",) if self.cfg.policy in SIM_POLICIES else ("real",)

    def check(self, mode, wl, hardware, fault) -> None:
        self.require_workload(wl, "varlen")
        self.require_no_fault(fault)
        wl.validate()
        if mode == "real":
            from impl.hydraulis.real.run import check_real

            check_real(self, wl, hardware)
        else:
            if self.cfg.policy not in SIM_POLICIES:
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
