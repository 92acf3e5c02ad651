"""HotSPa's rank 0 alone (``execution=estimate`` / ``rank0``, :mod:`impl.common.runtime.rank0`).

One case per length group of the plan (``system.boundaries`` / ``system.strategies`` on
``workload.num_gpus``): rank 0 of that group's strategy, built as Megatron builds a TP rank of
the workload's model, training a micro-batch packed to the group's bound (the longest any
micro-batch of that group holds). HotSPa switches between these strategies inside a step; each
case is the static rank of one of them, so the step model can price it as one launch.
"""
from __future__ import annotations

from impl.common.api import ConfigError, JobContext, RunResult
from impl.common.parallel.megatron_rank import RankStack
from impl.common.runtime.rank0 import Rank0Case, run_cases

from impl.hotspa.strategy import make_group_plan


def cases(system, wl, dtype: str) -> list[Rank0Case]:
    plan = make_group_plan(system.cfg.boundaries, system.cfg.strategies, wl.num_gpus)
    out = []
    for g, (s, bound) in enumerate(zip(plan.strategies, plan.boundaries)):
        if bound < 1:
            continue
        out.append(Rank0Case(f"group {g}: <= {bound} tokens, dp{s.dp} tp{s.tp} pp{s.pp}",
                             RankStack(tp=s.tp, dp=s.dp, pp=s.pp, dtype=dtype), ((int(bound),),)))
    return out


def check_rank0(system, wl, hardware) -> None:
    if system.cfg.grouping != "explicit":
        raise ConfigError(f"system.grouping: a rank-0 run builds the explicit boundaries and strategies, "
                          f"got {system.cfg.grouping!r}")
    if not wl.model.ffn_hidden:
        raise ConfigError("workload.model.ffn_hidden: the rank-0 builder is LLaMA-only (SwiGLU width > 0)")
    cases(system, wl, "bf16")  # the plan and every stack type-check here


def run_rank0_job(system, job: JobContext) -> RunResult:
    wl, ex = job.workload, job.execution
    res = run_cases(wl.model, cases(system, wl, ex.dtype_name(wl.dtype)), ex.ranks, job.hardware, lr=wl.lr,
                    stack_note="one static Megatron rank per HotSPa strategy; the switch's coexisting layouts "
                               "(home state plus every compute model) are not held together")
    res.info["policy"] = system.cfg.policy
    return res
