"""Checkpoint recovery under partial GPU loss (Elastor: Wang, Fu et al., PPoPP 2026, DOI
10.1145/3774934.3786445) and its baselines as harness systems (one class, the policy chosen by
a knob; baselines: impl/ckpt_recovery/README.md, "Reconstructed choices").

| system         | save                                  | after a loss                                  | modes     |
|----------------|---------------------------------------|-----------------------------------------------|-----------|
| ckpt_recovery  | async, snapshot overlapped, S splits  | every survivor, heterogeneous TP groups       | sim, real |
| dcp_sync       | torch DCP ``dcp.save``                | best rectangular mesh on the survivors         | sim, real |
| dcp_async      | ``dcp.async_save`` (staging blocks)   | best rectangular mesh on the survivors         | sim, real |
| dcp_async_process | the same, DCP's daemon process + reused shared-memory staging | as dcp_async | sim (= dcp_async), real |
| restart_all    | sync, one file per rank               | whole healthy nodes, homogeneous               | sim       |
| ucp_like       | sync; offline conversion at recovery  | best rectangular mesh on the survivors         | sim       |
| gemini_like    | every step into a buddy node's RAM    | whole healthy nodes; storage if both copies die| sim       |
| ckpt_recovery_peer | ours + each file in its owner's and k peers' RAM | as ckpt_recovery; storage if no copy lives | sim, real |

Sim mode lives in :mod:`impl.ckpt_recovery.sim.scenario` (knobs in the nested ``sim`` node), real mode
in :mod:`impl.ckpt_recovery.real` (knobs in ``real``). Faults: ``gpu_loss`` / ``node_loss``
(``impl.common.fault_model.spec``), one spec for both modes; ``none`` with ``sim.failures=poisson``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from impl.common.api import ConfigError, JobContext, RunResult, System

from impl.ckpt_recovery.policies import POLICIES as POLICY_REGISTRY
from impl.ckpt_recovery.real_config import CkptRealKnobs
from impl.ckpt_recovery.sim.config import CkptSimKnobs

POLICIES = POLICY_REGISTRY.names()


class CkptRecovery(System):
    @dataclass
    class Config:
        policy: str = "ckpt_recovery"
        real: CkptRealKnobs = field(default_factory=CkptRealKnobs)
        sim: CkptSimKnobs = field(default_factory=CkptSimKnobs)

        def __post_init__(self):
            if self.policy not in POLICIES:
                raise ConfigError(f"system.policy: unknown value {self.policy!r} (one of: {', '.join(POLICIES)})")

    @property
    def modes(self):  # type: ignore[override]
        return ("sim", "real") if POLICY_REGISTRY.get(self.cfg.policy).real is not None else ("sim",)

    def check(self, mode, wl, hardware, fault) -> None:
        self.require_workload(wl, "hybrid")
        if mode == "real":
            from impl.ckpt_recovery.real import check_real

            check_real(self, wl, hardware, fault)
        else:
            from impl.ckpt_recovery.sim.scenario import check_sim

            check_sim(self, wl, hardware, fault)

    def run(self, job: JobContext) -> RunResult:
        if job.mode == "real":
            from impl.ckpt_recovery.real import run_real

            return run_real(self, job)
        from impl.ckpt_recovery.sim.scenario import run_sim

        return run_sim(self, job)
