"""LobRA's rank 0 alone (``execution=estimate`` / ``rank0``, :mod:`impl.common.runtime.rank0`).

The replicas of LobRA's real mode are one GPU each (tp 1) and share the adapters by all-reducing
their gradients (every replica steps Adam on every adapter: no distributed optimizer), so rank 0
is a tp-1 rank of a ``workload.num_gpus``-way data-parallel group: the frozen bf16 base, one LoRA
adapter per task (``workload.lora_rank``) on q, k, v, o, gate, up, down. Two cases, one per replica
kind: ``R_L`` (activation checkpointing, ``large_max_tokens``) and ``R_S`` (none,
``small_max_tokens``), each training its largest micro-batch: the joint step's tasks each with an
equal share of the kind's ``max_tokens``, packed in one row.
"""
from __future__ import annotations

from impl.common.api import ConfigError, JobContext, RunResult
from impl.common.parallel.megatron_rank import RankStack
from impl.common.runtime.rank0 import Rank0Case, run_cases


def cases(system, wl, dtype: str) -> list[Rank0Case]:
    from impl.lobra.real import max_tokens_of

    caps = max_tokens_of(system, wl)
    n = len(wl.tasks)
    out = []
    for kind, recompute in (("R_L", "full"), ("R_S", "none")):
        cap = int(caps[kind])
        if cap < n:
            raise ConfigError(f"system.real: {kind}'s max_tokens {cap} cannot hold one token of each of {n} tasks")
        docs = tuple(cap // n + (1 if i < cap % n else 0) for i in range(n))
        out.append(Rank0Case(f"{kind}: {cap} tokens over {n} tasks, recompute {recompute}",
                             RankStack(tp=1, dp=wl.num_gpus, dtype=dtype, recompute=recompute,
                                       distributed_optimizer=False, lora_rank=wl.lora_rank, lora_tasks=n), (docs,)))
    return out


def check_rank0(system, wl, hardware) -> None:
    if not wl.model.ffn_hidden:
        raise ConfigError("workload.model.ffn_hidden: the rank-0 builder is LLaMA-only (SwiGLU width > 0)")
    cases(system, wl, "bf16")


def run_rank0_job(system, job: JobContext) -> RunResult:
    wl, ex = job.workload, job.execution
    res = run_cases(wl.model, cases(system, wl, ex.dtype_name(wl.dtype)), ex.ranks, job.hardware, lr=wl.lr,
                    lora_alpha=wl.lora_alpha,
                    stack_note="tracked: frozen bf16 base + LoRA adapters (only they have gradients and Adam "
                               "state); predicted: the step model prices full-parameter training of the same "
                               "rank (it has no frozen-base term), so its states term counts gradients and "
                               "optimizer state for the whole base")
    res.info["policy"] = system.cfg.policy
    return res
