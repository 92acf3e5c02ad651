"""LobRA sim mode (ours, impl/lobra/README.md): price every step of a multi-task LoRA job on a deployment.

Per job: derive the schemes (:mod:`impl.lobra.cost.step_model`), then
- lobra (and its ablations): take the authors' deployment for this GPU and task count from
  ``system.sim.replica_table`` (``deployment: table``, or ``auto`` when a row matches; the authors' scripts),
  plan one on an expected batch (``system.planner``), or take a homogeneous one
  (``system.deployment: homogeneous``); per step bucket the lengths
  (dynamic DP or fixed), dispatch (balanced ILP / length-based / even), cut micro-batches;
- task_fused: homogeneous replicas sized for the longest sequence (``system.sim.homogeneous``
  [tp, pp], the paper's configs in the presets), fixed buckets, even split;
- task_sequential: per task, the best homogeneous config of all N GPUs that fits that task's
  maximum, the task's batch alone; a joint step costs the sum over tasks.
A replica's time is ``Σ t + (pp−1)·max t`` over its micro-batches; the step is the slowest
replica plus the adapter-gradient all-reduce (every adapter is global to its job) plus the
per-step overhead (``system.sim.step_overhead_s``; by default the step model's per-iteration
overhead, paid per task step by Task-Sequential). GPU-seconds
= N × step, summed over the measured steps. Seeded and deterministic.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from impl.common.api import ConfigError, Metric, RunResult
from impl.common.cost.comm import ring_allreduce_time_s
from impl.common.megatron.derive import step_knobs

from impl.lobra.cost.replica import Scheme, pow2_ceil, replica_time
from impl.lobra.dispatch import ReplicaGroup
from impl.lobra.joint_step import TaskStreams, boundaries_for, plan_bucketed, plan_step
from impl.lobra.plan import plan
from impl.lobra.policies import POLICIES
from impl.lobra.cost.step_model import SimCostKnobs, lora_params_per_layer, sim_schemes, table3_check


def _knobs(system, wl, hw) -> SimCostKnobs:
    k = system.cfg.sim
    return SimCostKnobs(profile_lengths=tuple(k.profile_lengths), lora_matrix_factor=float(k.lora_matrix_factor))


def step_overhead_s(system, hw, wl=None) -> float:
    """Per optimizer step: the knob, or (< 0) the step model's per-iteration terms
    (:func:`impl.common.megatron.step.optimizer_step_s`, every training system's one rule): Adam
    over every task's LoRA adapters on one GPU and the per-iteration overhead."""
    from impl.common.megatron.step import optimizer_step_s

    k = system.cfg.sim.step_overhead_s
    if k >= 0:
        return float(k)
    lora = lora_params_per_layer(wl.model, wl.lora_rank) * wl.model.num_layers * len(wl.tasks) if wl else 0.0
    return optimizer_step_s(float(lora), 1, hw)


def table_row(cfg, wl):
    """The replica-table row for this GPU and task count, or None."""
    for row in cfg.sim.replica_table:
        if row.gpus == wl.num_gpus and row.tasks in (0, len(wl.tasks)):
            return row
    return None


def deployment_of(cfg, wl) -> str:
    """What a lobra-policy job deploys: table | planned | homogeneous (``auto`` resolved)."""
    if cfg.deployment == "auto":
        return "table" if table_row(cfg, wl) is not None else "planned"
    return cfg.deployment


def _scheme(schemes, tp: int, pp: int, field: str) -> Scheme:
    match = [s for s in schemes if (s.tp, s.pp) == (tp, pp)]
    if not match:
        raise ConfigError(f"{field}: [tp {tp}, pp {pp}] holds none of the profile lengths on this model and "
                          f"hardware (have {[s.label for s in schemes]})")
    return match[0]


def _with_max_tokens(s: Scheme, m: int) -> Scheme:
    return dataclasses.replace(s, max_tokens=int(m))


def table_groups(cfg, wl, schemes) -> tuple[list[ReplicaGroup], dict]:
    """The authors' deployment for this setup; max_tokens ours (rule) or theirs (table)."""
    row = table_row(cfg, wl)
    if row is None:
        raise ConfigError(f"system.sim.replica_table: no row for {wl.num_gpus} GPUs and {len(wl.tasks)} tasks "
                          f"(rows: {[(r.gpus, r.tasks) for r in cfg.sim.replica_table]})")
    groups, cmp = [], []
    for dp, tp, pp, theirs in row.replicas:
        s = _scheme(schemes, tp, pp, "system.sim.replica_table")
        ours = s.max_tokens
        groups.append(ReplicaGroup(s if cfg.sim.max_tokens_from == "rule" else _with_max_tokens(s, theirs), dp))
        cmp.append({"replica": f"{dp}x(tp{tp},pp{pp})", "max_tokens_table": theirs, "max_tokens_rule": ours})
    top = max(g.scheme.max_tokens for g in groups)
    if top < wl.max_len:
        raise ConfigError(f"system.sim.replica_table: the row for {wl.num_gpus} GPUs holds at most {top} tokens "
                          f"({cfg.sim.max_tokens_from}), below the longest sequence {wl.max_len}")
    return groups, {"source": "authors' replica table", "max_tokens_from": cfg.sim.max_tokens_from,
                    "max_tokens": cmp}


def schemes_for(system, wl, hw, num_tasks: int):
    cap = pow2_ceil(wl.max_len)
    return sim_schemes(wl.model, hw, _knobs(system, wl, hw), wl.num_gpus, num_tasks, wl.lora_rank, cap)


def homogeneous(schemes, num_gpus: int, tp_pp, need: int, field: str, hold_longest: bool = False) -> ReplicaGroup:
    """``hold_longest``: the authors' tables size these replicas for the longest sequence (their
    max_tokens, not ours)."""
    tp, pp = tp_pp
    s = _scheme(schemes, tp, pp, field)
    if hold_longest:
        s = _with_max_tokens(s, max(s.max_tokens, need))
    if num_gpus % s.gpus:
        raise ConfigError(f"{field}: {num_gpus} GPUs is not a multiple of {s.label}'s {s.gpus}")
    if s.max_tokens < need:
        raise ConfigError(f"{field}: {s.label} holds {s.max_tokens} tokens, below the longest sequence {need}")
    return ReplicaGroup(s, num_gpus // s.gpus)


def expected_batch(wl, seed: int, boundaries_kind: str, system) -> tuple[list[int], list[int]]:
    """A representative step: every task's lengths at the quantiles (k + 0.5)/GBS of a large
    sample of its distribution, bucketed like the system buckets."""
    from impl.common.llm.lora_train import Sample

    samples = []
    rng = np.random.default_rng(seed + 7)
    for t in wl.tasks:
        big = np.sort(t.lengths.sample(max(4096, 32 * t.batch_seqs), rng))
        q = big[((np.arange(t.batch_seqs) + 0.5) / t.batch_seqs * len(big)).astype(int)]
        samples += [Sample(t.name, i, int(x)) for i, x in enumerate(q)]
    bs = boundaries_for(samples, boundaries_kind, num_buckets=system.cfg.num_buckets, fixed=_fixed(system, wl))
    from impl.lobra.bucketing import assign

    a = assign([s.length for s in samples], bs)
    counts = [a.count(b) for b in bs]
    return [b for b, c in zip(bs, counts) if c], [c for c in counts if c]


def _fixed(system, wl) -> list[int]:
    return list(system.cfg.fixed_buckets)


def sync_time_s(wl, hw, groups, num_tasks: int) -> float:
    """Ring all-reduce of every GPU's adapter-gradient shard (bf16) over all replicas."""
    replicas = sum(g.dp for g in groups)
    if replicas < 2:
        return 0.0
    shard = max(1, min(g.scheme.gpus for g in groups))
    nbytes = 2.0 * lora_params_per_layer(wl.model, wl.lora_rank) * wl.model.num_layers * num_tasks / shard
    # replicas sit on different nodes: one rank per node, each ring over one NIC
    return ring_allreduce_time_s(nbytes, replicas, hw, 1)


def step_time(groups, sp) -> float:
    return max(replica_time(g.scheme, [(len(mb), s) for s, mb in r]) for j, g in enumerate(groups)
               for r in sp.replicas[j])


def simulate(system, wl, hw, seed: int) -> tuple[dict, dict]:
    cfg = system.cfg
    names = [t.name for t in wl.tasks]
    schemes = schemes_for(system, wl, hw, len(wl.tasks))
    info: dict = {"num_gpus": wl.num_gpus, "model": wl.model.name, "tasks": names,
                  "schemes": {s.label: round(s.throughput_per_gpu(), 1) for s in schemes},
                  "table3_check": table3_check(wl.model, hw, _knobs(system, wl, hw)),
                  "cost_source": "Megatron step model (LoRA GEMMs x 2/3), its memory; max_tokens by the "
                                 "profile_memory rule; not profiled"}
    solver = dict(time_limit_s=cfg.ilp_time_limit_s, mip_gap=cfg.ilp_gap) if cfg.dispatch == "balanced" else {}
    streams = TaskStreams(wl.tasks, seed)
    steps, pads, solve, statuses = [], [], [], []
    cut_steps = 0
    planner_s = 0.0
    overhead = step_overhead_s(system, hw, wl)
    info["step_overhead_s"] = overhead
    from_table = cfg.sim.max_tokens_from == "table"
    policy = POLICIES.get(cfg.policy)
    if policy.per_task:
        per_task = {}
        t0 = time.perf_counter()
        for t in wl.tasks:
            need = t.lengths.max_len
            best = None
            allowed = {tuple(c[:2]): (c[2] if len(c) > 2 else 0) for c in cfg.sim.sequential_configs}
            for s in schemes:
                if allowed and (s.tp, s.pp) not in allowed:
                    continue
                if from_table and allowed.get((s.tp, s.pp)):
                    s = _with_max_tokens(s, allowed[(s.tp, s.pp)])
                if s.max_tokens < need or wl.num_gpus % s.gpus:
                    continue
                g = [ReplicaGroup(s, wl.num_gpus // s.gpus)]
                one = type(wl)(**{**wl.__dict__, "tasks": [t]})
                bk, cnt = expected_batch(one, seed, "fixed", system)
                from impl.lobra.dispatch import even

                tt = even(g, bk, cnt).objective_s
                if best is None or tt < best[0]:
                    best = (tt, g)
            if best is None:
                raise ConfigError(f"workload.tasks: task {t.name!r} (max {need}) fits no homogeneous config of "
                                  f"{wl.num_gpus} GPUs")
            per_task[t.name] = best[1]
        planner_s = time.perf_counter() - t0
        info["deployment"] = {n: [f"{g.dp}x{g.scheme.label}" for g in gs] for n, gs in per_task.items()}
        for _ in range(wl.steps):
            samples = streams.step()
            total, real, padded = 0.0, 0, 0
            for t in wl.tasks:
                mine = [s for s in samples if s.task == t.name]
                gs = per_task[t.name]
                bs = boundaries_for(mine, "fixed", num_buckets=cfg.num_buckets, fixed=_fixed(system, wl))
                sp = plan_step(gs, mine, bs, "even", exec_mode=cfg.exec_mode, min_len=cfg.min_bucket_len)
                total += step_time(gs, sp) + sync_time_s(wl, hw, gs, 1) + overhead
                real += sp.real_tokens
                padded += sp.padded_tokens
            steps.append(total)
            pads.append((padded - real) / padded)
    else:
        kind = policy.deployment or deployment_of(cfg, wl)
        info["deployment_kind"] = kind
        if kind == "homogeneous":
            groups = [homogeneous(schemes, wl.num_gpus, cfg.sim.homogeneous, pow2_ceil(wl.max_len),
                                  "system.sim.homogeneous", hold_longest=from_table)]
            info["deployment"] = [f"{g.dp}x{g.scheme.label}" for g in groups]
        elif kind == "table":
            groups, info["replica_table"] = table_groups(cfg, wl, schemes)
            info["deployment"] = [f"{g.dp}x{g.scheme.label}" for g in groups]
        else:
            bk, cnt = expected_batch(wl, seed, cfg.bucketing, system)
            p = plan(schemes, wl.num_gpus, bk, cnt, wl.max_len, planner=cfg.planner, keep_within=cfg.keep_within,
                     keep_min=cfg.keep_min, keep_max=cfg.keep_max, time_limit_s=cfg.plan_time_limit_s,
                     mip_gap=cfg.ilp_gap,
                     use_pool=cfg.scheme_pool)
            groups, planner_s = p.groups, p.planner_s
            info.update(deployment=p.describe(), planner_candidates=p.candidates, planner_kept=p.kept,
                        planner_info=p.info, expected_step_s=p.expected_step_s)
        dispatcher = policy.dispatcher(cfg)
        bucketing_kind = policy.bucketing_kind(cfg)
        sync = sync_time_s(wl, hw, groups, len(wl.tasks))
        for _ in range(wl.steps):
            samples = streams.step()
            sp = plan_bucketed(groups, samples, bucketing_kind, dispatcher, num_buckets=cfg.num_buckets,
                               fixed=_fixed(system, wl), cuts=cfg.bucket_cuts, min_len=cfg.min_bucket_len,
                               exec_mode=cfg.exec_mode, task_order=names, **solver)
            steps.append(step_time(groups, sp) + sync + overhead)
            pads.append(sp.pad_ratio)
            solve.append(sp.dispatch.solve_s)
            statuses.append(sp.dispatch.status)
            cut_steps += bool(sp.info.get("bucket_cuts"))
        info["sync_time_s"] = sync
        info["dispatch_status"] = sorted(set(statuses))
        info["steps_with_bucket_cuts"] = cut_steps
    gpu_s = [wl.num_gpus * s for s in steps]
    m = {
        "gpu_seconds": Metric.scalar(sum(gpu_s), "GPU-s"),
        "gpu_seconds_per_step": Metric.from_samples(gpu_s, "GPU-s"),
        "step_time_s": Metric.from_samples(steps, "s"),
        "padding_ratio": Metric.from_samples(pads, "ratio"),
        "planner_time_s": Metric.scalar(planner_s, "s"),
    }
    if solve:
        m["dispatch_solve_s"] = Metric.from_samples(solve, "s")
    return m, info


def run_sim(system, job) -> RunResult:
    metrics, info = simulate(system, job.workload, job.hardware, job.seed)
    info["steps"] = job.workload.steps
    return RunResult(metrics=metrics, info=info)
