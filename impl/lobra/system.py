"""LobRA and its baselines as harness systems (one class, the policy chosen by a knob).

| system           | deployment                          | buckets        | dispatch        | modes     |
|------------------|-------------------------------------|----------------|-----------------|-----------|
| lobra            | planned heterogeneous (PRUNE)       | dynamic, B=16  | balanced ILP    | sim, real |
| task_fused       | homogeneous, sized for the longest  | fixed 7        | even            | sim, real |
| task_sequential  | per task, its best homogeneous      | fixed 7        | even            | sim, real |

The ablation ladder (the authors' ablations) is ``lobra`` with ``deployment``, ``dispatch`` and ``bucketing``
changed (conf/system/lobra/*.yaml). Real mode: :mod:`impl.lobra.real`; sim: :mod:`impl.lobra.sim`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List

from impl.common.api import ConfigError, JobContext, RunResult, System

from impl.lobra.dispatch import DISPATCHERS, Dispatcher
from impl.lobra.joint_step import BUCKET_CUTS, BUCKETINGS, BucketCuts, Bucketing
from impl.lobra.plan import PLANNERS, DeploymentPlanner
from impl.lobra.cost.step_model import LORA_MATRIX_FACTOR, PROFILE_LENGTHS
from impl.lobra.policies import POLICIES
DEPLOYMENTS = ("auto", "planned", "homogeneous", "table")
MAX_TOKENS_FROM = ("rule", "table")


@dataclass
class ReplicaRow:
    """One row of the authors' replica tables (Hetu `examples/lobra` scripts): the deployment of ``gpus`` GPUs (and
    ``tasks`` tasks; 0 = any count) as ``[dp, tp, pp, max_tokens]`` per replica group."""

    gpus: int = 0
    tasks: int = 0
    replicas: List[List[int]] = field(default_factory=list)
class ExecMode(enum.StrEnum):
    """Real mode's step: mixed-task micro-batches through the multi-LoRA layer (fused), or one task's
    adapter at a time (single, ``set_adapter``)."""

    fused = "fused"
    single = "single"


EXEC_MODES = tuple(ExecMode)


@dataclass
class LobRASimKnobs:
    # Homogeneous [tp, pp] of Task-Fused (and deployment=homogeneous): the authors' configs (artifact experiments/expr_*.sh).
    homogeneous: List[int] = field(default_factory=lambda: [8, 1])
    # Task-Sequential: the [tp, pp] (or [tp, pp, max_tokens] from the authors' table) configs a task
    # may run on (paper appendix, Table 6; the authors' scripts); empty = any scheme.
    sequential_configs: List[List[int]] = field(default_factory=list)
    # max_tokens per (tp, pp): the authors' profile_memory rule tries these lengths.
    profile_lengths: List[int] = field(default_factory=lambda: list(PROFILE_LENGTHS))
    # The authors' replica tables (deployment=table, or auto when a row matches).
    replica_table: List[ReplicaRow] = field(default_factory=list)
    # A table deployment's max_tokens: rule (ours, profile_memory on the memory model) | table.
    max_tokens_from: str = "rule"
    # Per optimizer step (Task-Sequential: per task step): < 0 = the step model's per-iteration overhead.
    step_overhead_s: float = -1.0
    # Share of the base model's GEMM time a LoRA step pays: forward + input gradient, no weight
    # gradient of the frozen base = 2/3 of the three GEMMs (a sensitivity input).
    lora_matrix_factor: float = LORA_MATRIX_FACTOR

    def __post_init__(self):
        if self.max_tokens_from not in MAX_TOKENS_FROM:
            raise ConfigError(f"system.sim.max_tokens_from: unknown value {self.max_tokens_from!r} "
                              f"(one of: {', '.join(MAX_TOKENS_FROM)})")
        if not 0 < self.lora_matrix_factor <= 1:
            raise ConfigError(f"system.sim.lora_matrix_factor: must be in (0, 1], got {self.lora_matrix_factor}")
        if not self.profile_lengths or min(self.profile_lengths) < 1:
            raise ConfigError(f"system.sim.profile_lengths: need lengths >= 1, got {list(self.profile_lengths)}")
        for i, row in enumerate(self.replica_table):
            if row.gpus < 1 or row.tasks < 0 or not row.replicas:
                raise ConfigError(f"system.sim.replica_table[{i}]: need gpus >= 1, tasks >= 0 and replicas")
            for r in row.replicas:
                if len(r) != 4 or min(r) < 1:
                    raise ConfigError(f"system.sim.replica_table[{i}].replicas: {list(r)} is not [dp, tp, pp, "
                                      f"max_tokens] >= 1")
            if sum(r[0] * r[1] * r[2] for r in row.replicas) != row.gpus:
                raise ConfigError(f"system.sim.replica_table[{i}]: replicas use "
                                  f"{sum(r[0] * r[1] * r[2] for r in row.replicas)} GPUs, the row says {row.gpus}")
        if len(self.homogeneous) != 2 or min(self.homogeneous) < 1:
            raise ConfigError(f"system.sim.homogeneous: must be [tp, pp] >= 1, got {self.homogeneous}")


@dataclass
class LobRARealKnobs:
    # Replica proxies (the real experiments, impl/lobra/README.md): checkpointing + max_tokens per replica kind.
    large_max_tokens: int = 2048
    small_max_tokens: int = 512
    # > 0: both caps by the authors' profile_memory rule on this per-rank budget
    # (impl/lobra/real_memory.py), the two knobs above then unused; the lengths it tries.
    memory_budget_bytes: float = 0.0
    memory_profile_lengths: List[int] = field(default_factory=lambda: [256, 512, 1024, 2048])
    # The cost fit per replica: mbs and s grid of timed micro-batches.
    profile_mbs: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
    profile_lengths: List[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048])
    profile_reps: int = 1
    # Rounds whose adapter gradients rank 0 recomputes in one process (0: none).
    check_steps: int = 1
    grad_rtol: float = 1e-5
    init_b_zero: bool = True  # peft's default B = 0; False draws B (the gradient tests need it)
    # Run these policies interleaved in one job (one step each per round); empty = this one.
    interleave: List[str] = field(default_factory=list)
    timeout_s: float = 3000.0

    def __post_init__(self):
        for p in self.interleave:
            if p not in POLICIES:
                raise ConfigError(f"system.real.interleave: unknown policy {p!r} (one of: {', '.join(POLICIES.names())})")


class LobRA(System):
    @dataclass
    class Config:
        policy: str = "lobra"
        # auto: the authors' table row for this GPU and task count if sim.replica_table has one,
        # else planned | planned (PRUNE/GROUP/BALANCE) | homogeneous (sim.homogeneous) | table
        deployment: str = "auto"
        planner: DeploymentPlanner = DeploymentPlanner.prune
        scheme_pool: bool = True  # ablation: pool pruning on/off
        keep_within: float = 0.15
        keep_min: int = 8
        keep_max: int = 12  # harness cap on candidates the ILP re-scores (time)
        plan_time_limit_s: float = 2.0  # ILP limit per candidate while planning
        dispatch: Dispatcher = Dispatcher.balanced
        bucketing: Bucketing = Bucketing.dynamic
        # dynamic buckets vs the deployed replicas' max_tokens (joint_step.plan_bucketed)
        bucket_cuts: BucketCuts = BucketCuts.auto
        num_buckets: int = 16
        fixed_buckets: List[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192, 16384])
        min_bucket_len: int = 0  # the original code's 256 floor (off by default; the artifact applies none)
        exec_mode: ExecMode = ExecMode.fused
        ilp_time_limit_s: float = 5.0
        ilp_gap: float = 0.005
        sim: LobRASimKnobs = field(default_factory=LobRASimKnobs)
        real: LobRARealKnobs = field(default_factory=LobRARealKnobs)

        def __post_init__(self):
            for fld, allowed in (("policy", POLICIES.names()), ("deployment", DEPLOYMENTS), ("planner", PLANNERS),
                                 ("dispatch", DISPATCHERS), ("bucketing", BUCKETINGS), ("exec_mode", EXEC_MODES),
                                 ("bucket_cuts", BUCKET_CUTS)):
                if getattr(self, fld) not in allowed:
                    raise ConfigError(f"system.{fld}: unknown value {getattr(self, fld)!r} (one of: {', '.join(allowed)})")
            if self.num_buckets < 1:
                raise ConfigError(f"system.num_buckets: must be >= 1, got {self.num_buckets}")
            if not self.fixed_buckets or sorted(set(self.fixed_buckets)) != list(self.fixed_buckets):
                raise ConfigError(f"system.fixed_buckets: must be strictly increasing and non-empty, got {self.fixed_buckets}")
            if self.ilp_time_limit_s <= 0 or not 0 <= self.ilp_gap < 1:
                raise ConfigError(f"system.ilp_time_limit_s ({self.ilp_time_limit_s}) must be > 0 and system.ilp_gap "
                                  f"({self.ilp_gap}) in [0, 1)")

    def check(self, mode, wl, hardware, fault) -> None:
        self.require_workload(wl, "multitask_lora")
        self.require_no_fault(fault)
        wl.validate()
        if mode == "sim":
            if "bf16" not in hardware.peak_flops:
                raise ConfigError(f"hardware {hardware.name}: sim mode prices bf16 compute, which the profile lacks")
            from impl.lobra.sim import schemes_for

            schemes = schemes_for(self, wl, hardware, len(wl.tasks))
            top = max((s.max_tokens for s in schemes), default=0)
            if top < wl.max_len:
                raise ConfigError(f"workload.tasks: the longest sequence {wl.max_len} is beyond every replica's "
                                  f"max_tokens (largest {top})")
            if POLICIES.get(self.cfg.policy).bucketing_kind(self.cfg) == "fixed":
                if self.cfg.fixed_buckets[-1] < wl.max_len:
                    raise ConfigError(f"system.fixed_buckets: largest {self.cfg.fixed_buckets[-1]} is below the "
                                      f"longest sequence {wl.max_len}")
        else:
            from impl.lobra.real import check_real

            check_real(self, wl, hardware)

    rank0_builder = True

    def check_rank0(self, wl, hardware, fault) -> None:
        self.require_workload(wl, "multitask_lora")
        self.require_no_fault(fault)
        wl.validate()
        from impl.lobra.estimate import check_rank0

        check_rank0(self, wl, hardware)

    def run(self, job: JobContext) -> RunResult:
        if job.mode == "real" and job.execution.ranks != "all":
            from impl.lobra.estimate import run_rank0_job

            return run_rank0_job(self, job)
        if job.mode == "real":
            from impl.lobra.real import run_real

            return run_real(self, job)
        from impl.lobra.sim import run_sim

        return run_sim(self, job)
