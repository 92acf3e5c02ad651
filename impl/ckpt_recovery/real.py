"""Real mode of the checkpoint-recovery system (scenario A, impl/ckpt_recovery/README.md): gloo ranks
train the tiny decoder TP x PP, a seeded rank is SIGKILLed at a seeded step (optionally in the
middle of a save), the supervisor detects it, stops the survivors, re-lays them out and
relaunches them from the last committed checkpoint (:mod:`impl.ckpt_recovery.recovery`).

Policies: ``ckpt_recovery`` (async split checkpoints, planner re-plan on every survivor),
``dcp_sync`` / ``dcp_async`` (torch DCP, best homogeneous fit), ``restart_all`` (our
checkpoints, best homogeneous fit). ``ucp_like`` / ``gemini_like`` are sim only.
``ckpt_recovery_peer`` is ``ckpt_recovery`` with ``real.peer_copies`` >= 1: one holder process
per emulated node keeps every rank file in its node's shared memory and in k other nodes'
(:mod:`impl.common.checkpoint.holder`); the victim's SIGKILL takes its node's holder, and the
relaunch reads each file from the nearest surviving holder, from storage only where none has it.

ETTR here = useful training time / the job's wall clock, where useful training time counts
each step once at its final run's measured time (steps redone after the failure count once,
the lost first runs not at all) and the wall clock runs from the first launch to the end
(start-up, saves, detection, restart, load and rework included).
"""
from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
from typing import Optional

from impl.common.api import ConfigError, JobContext, Metric, RunResult
from impl.common.checkpoint.layout import check_layout, pipeline_layout
from impl.common.parallel.tensor_parallel import check_tp_shape
from impl.common.storage.emulator import profile

from impl.ckpt_recovery.policies import REAL_POLICIES
from impl.ckpt_recovery.real_config import RELAYOUTS, SCENARIOS, STORAGES, CkptRealKnobs
from impl.ckpt_recovery.recovery import replan as R
from impl.ckpt_recovery.recovery.supervisor import run, timeline
from impl.ckpt_recovery.recovery.trainer import KillAt, PeerSpec, TrainSpec, full_metas



def knobs(system) -> CkptRealKnobs:
    k = getattr(system.cfg, "real", None)
    return k if k is not None else CkptRealKnobs()


def cluster(wl, k: CkptRealKnobs) -> R.Cluster:
    alpha = tuple(wl.alpha) if wl.alpha else (1.0, 2.0, 4.0, 8.0)
    return R.Cluster(wl.num_gpus, wl.gpus_per_node, wl.tp, wl.pp, wl.model.num_layers, wl.num_microbatches,
                     alpha, k.mem_budget)


def check_real(system, wl, hardware, fault) -> None:
    k = knobs(system)
    policy = system.cfg.policy
    if k.scenario not in SCENARIOS:
        raise ConfigError(f"real.scenario: unknown value {k.scenario!r} (one of: {', '.join(SCENARIOS)})")
    if k.scenario == "one_gpu":
        from impl.ckpt_recovery import one_gpu

        if k.storage not in STORAGES:
            raise ConfigError(f"real.storage: unknown {k.storage!r} (one of: {', '.join(STORAGES)})")
        one_gpu.check(wl, k, policy, fault)
        return
    if policy not in REAL_POLICIES:
        raise ConfigError(f"policy: {policy!r} is sim only (real mode runs {', '.join(REAL_POLICIES)})")
    if k.storage not in STORAGES:
        raise ConfigError(f"real.storage: unknown {k.storage!r} (one of: {', '.join(STORAGES)})")
    if k.relayout not in RELAYOUTS:
        raise ConfigError(f"real.relayout: unknown {k.relayout!r} (one of: {', '.join(RELAYOUTS)})")
    if getattr(wl, "kind", None) != "hybrid":
        raise ConfigError(f"workload: real checkpoint recovery needs a hybrid workload, got kind {getattr(wl, 'kind', None)!r}")
    if wl.dp != 1:
        raise ConfigError(f"workload.dp: the real trainer runs one pipeline (dp=1), got dp={wl.dp}")
    if wl.tp * wl.pp != wl.num_gpus:
        raise ConfigError(f"workload: tp*pp = {wl.tp}*{wl.pp} != num_gpus {wl.num_gpus}")
    if wl.global_batch_size % wl.micro_batch_size:
        raise ConfigError(f"workload.global_batch_size: {wl.global_batch_size} is not a multiple of "
                          f"micro_batch_size {wl.micro_batch_size}")
    if k.ckpt_every < 1 or k.splits < 1:
        raise ConfigError(f"real.ckpt_every / real.splits: must be >= 1, got {k.ckpt_every} / {k.splits}")
    check_tp_shape(wl.model, wl.tp, "workload.tp")
    metas = full_metas(wl.model, 0)
    check_layout(metas, pipeline_layout(metas, [list(R.uniform_stages(wl.tp, wl.pp, wl.model.num_layers))],
                                        wl.model.num_layers), k.splits)
    if k.peer_copies:
        check_peer(k, wl, backend=REAL_POLICIES[policy][0], state_bytes=sum(m.nbytes for m in metas))
    kind = getattr(fault, "kind", "none")
    if kind not in ("none", "gpu_loss"):
        raise ConfigError(f"fault.kind: real mode injects gpu_loss (one rank SIGKILLed), got {kind!r}")
    if kind == "gpu_loss":
        ranks = list(getattr(fault, "ranks", []) or [])
        if len(ranks) > 1 or any(not 0 <= r < wl.num_gpus for r in ranks):
            raise ConfigError(f"fault.ranks: real mode kills one rank of 0..{wl.num_gpus - 1}, got {ranks}")
        at = getattr(fault, "at_step", None)
        if at is not None and at >= 0 and not k.ckpt_every < at < wl.iterations:
            raise ConfigError(f"fault.at_step: {at} must lie after the first save (step {k.ckpt_every}) and before "
                              f"the last step {wl.iterations}")


def check_peer(k: CkptRealKnobs, wl, backend: str, state_bytes: float) -> None:
    """The peer tier's knobs, and its copies against the host's shared memory (one line)."""
    if k.peer_copies < 0:
        raise ConfigError(f"real.peer_copies: must be >= 0, got {k.peer_copies}")
    if backend != "elastor":
        raise ConfigError(f"real.peer_copies: peer copies hold our split files; backend {backend!r} has none "
                          f"(policy ckpt_recovery or restart_all)")
    if k.peer_net not in STORAGES + ("net",):
        raise ConfigError(f"real.peer_net: unknown {k.peer_net!r} (one of: {', '.join(STORAGES + ('net',))})")
    if wl.num_gpus % wl.gpus_per_node:
        raise ConfigError(f"workload.gpus_per_node: {wl.gpus_per_node} does not divide num_gpus {wl.num_gpus}")
    nodes = wl.num_gpus // wl.gpus_per_node
    if k.peer_copies > nodes - 1:
        raise ConfigError(f"real.peer_copies: {k.peer_copies} copies off the owner's node need >= "
                          f"{k.peer_copies + 1} emulated nodes, the workload has {nodes}")
    cap = k.host_mem_bytes or (shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else float("inf"))
    # One host holds every emulated node: the snapshots, the staging (2 steps) and (1 + k)
    # copies of 2 commits (the committed one and the one being copied in).
    need = 3 * state_bytes + 2 * (1 + k.peer_copies) * state_bytes
    if need > cap:
        raise ConfigError(f"real.host_mem_bytes: peer copies do not fit: snapshots {state_bytes / 1e6:.0f} MB + staging "
                          f"{2 * state_bytes / 1e6:.0f} MB + 2 x {1 + k.peer_copies} copies of {state_bytes / 1e6:.0f} MB "
                          f"= {need / 1e6:.0f} MB > {cap / 1e6:.0f} MB of shared memory")


def _peer(wl, k: CkptRealKnobs, root: str) -> Optional[PeerSpec]:
    if not k.peer_copies:
        return None
    base = tempfile.mkdtemp(prefix="ckpt-peer-", dir="/dev/shm" if os.path.isdir("/dev/shm") else root)
    nodes = wl.num_gpus // wl.gpus_per_node
    return PeerSpec(base, k.peer_copies, nodes, tuple(r // wl.gpus_per_node for r in range(wl.num_gpus)),
                    tuple(range(nodes)), profile(k.peer_net))


def _kill(job: JobContext, wl, k: CkptRealKnobs):
    f = job.fault
    if getattr(f, "kind", "none") != "gpu_loss":
        return None
    rng = random.Random(f"{job.seed}/{getattr(f, 'seed', 0)}")
    ranks = list(getattr(f, "ranks", []) or [])
    last_stage = list(range((wl.pp - 1) * wl.tp, wl.pp * wl.tp))
    victim = ranks[0] if ranks else rng.choice(last_stage)  # scenario A: a stage-1 rank
    at = getattr(f, "at_step", None)
    if at is None or at < 0:
        at = rng.randint(2 * k.ckpt_every, wl.iterations - 2)
    return KillAt(victim, at, bool(getattr(f, "mid_save", False)))


def run_real(system, job: JobContext) -> RunResult:
    wl, k = job.workload, knobs(system)
    if k.scenario == "one_gpu":
        from impl.ckpt_recovery import one_gpu

        prof = profile(k.storage)
        o = one_gpu.run(system.cfg.policy, wl, k, job.seed, job.execution, prof)
        return one_gpu.result(o, system.cfg.policy, prof, job.execution, k)
    backend, relayout = REAL_POLICIES[system.cfg.policy]
    if k.relayout != "auto":
        relayout = k.relayout
    prof = profile(k.storage)
    c = cluster(wl, k)
    metas = full_metas(wl.model, job.seed)
    fns = {"replan": lambda lost: R.replan(c, lost, metas),
           "homogeneous": lambda lost: R.homogeneous(c, lost, metas, wl.model.heads),
           "same": lambda lost: R.same(c, metas)}
    with tempfile.TemporaryDirectory(prefix="ckpt-real-") as root:  # checkpoints are scratch, not results
        peer = _peer(wl, k, root)
        try:
            spec = TrainSpec(wl.model, job.seed, R.uniform_stages(wl.tp, wl.pp, wl.model.num_layers),
                             steps=wl.iterations, global_batch=wl.global_batch_size, micro_batches=wl.num_microbatches,
                             root=root, backend=backend, lr=wl.lr, dropout=k.dropout, ckpt_every=k.ckpt_every,
                             splits=k.splits, keep=k.keep, prof=prof, kill=_kill(job, wl, k), threads=k.threads,
                             peer=peer)
            o = run(spec, fns[relayout], hb_timeout_s=k.hb_timeout_s, timeout_s=k.timeout_s)
        finally:
            if peer is not None:
                shutil.rmtree(peer.base, ignore_errors=True)
    return result(o, spec, prof, relayout)


def result(o, spec: TrainSpec, prof, relayout: str) -> RunResult:
    w1 = o.before
    stalls = w1.stalls or [x for r in o.results for x in r["stall_s"]]
    commits = [s for _, s in w1.commits] or [s for r in o.results for _, s in r["ckpt"]["commit_s"]]
    m = {"t_stall_s": Metric.from_samples(stalls, "s") if stalls else Metric.scalar(float("nan"), "s"),
         "t_commit_s": Metric.from_samples(commits, "s") if commits else Metric.scalar(float("nan"), "s")}
    info: dict = {"backend": spec.backend, "relayout": relayout, "storage": prof.label(),
                  "layout_before": R.format_layout([list(spec.stages)]), "saves_started": w1.saves,
                  "commits": w1.commits, "losses": o.losses()}
    if o.after is None:
        steps = [v for r in o.results[:1] for v in r["step_s"].values()]
        m["ettr"] = Metric.scalar(sum(steps) / o.t_wall_s, "ratio", "higher")
        m["ranks_after"] = Metric.scalar(len(o.results), "ranks", "higher")
    else:
        t = timeline(o)
        for key in ("t_load_s", "t_lost_s", "t_detect_s", "t_restart_s", "t_plan_s", "t_rework_s",
                    "t_load_metadata_s", "t_load_io_s", "t_load_assembly_s", "t_stop_s", "t_spawn_s",
                    "t_saver_start_s"):
            if key in t:
                m[key] = Metric.scalar(t[key], "s")
        m["read_calls"] = Metric.scalar(statistics.median(t["read_calls_per_rank"]), "calls")
        m["read_amplification"] = Metric.scalar(max(t["read_amplification_per_rank"]), "ratio")
        m["ettr"] = Metric.scalar(t["ettr"], "ratio", "higher")
        m["throughput_after_over_before"] = Metric.scalar(t["throughput_after_over_before"], "ratio", "higher")
        m["ranks_after"] = Metric.scalar(t["ranks_after"], "ranks", "higher")
        info.update({k: v for k, v in t.items() if not isinstance(v, float) or k.startswith("step_s")})
        info["layout_after"] = o.relayout.describe()
        if spec.peer is not None:
            # Where the recovery's slices came from (summed over ranks): this node's memory,
            # another node's, or the emulated NAS (only for files no live holder had).
            loads = [r["load"] for r in o.results]
            for key in ("slices_local", "slices_peer", "slices_storage", "storage_read_calls"):
                m[key] = Metric.scalar(float(sum(x[key] for x in loads)), "slices" if key.startswith("slices") else "calls")
            info["peer"] = {**(o.peer or {}), "copies": spec.peer.copies, "net": spec.peer.net.label(),
                            "sources_per_rank": [x["sources"] for x in loads]}
        info["device_of_new_rank"] = list(o.relayout.device_of)
    emulated = [prof.label()] if prof.emulated else []
    if spec.peer is not None and spec.peer.net.emulated:
        emulated.append(spec.peer.net.label())
    return RunResult(metrics=m, emulated=emulated, info=info)
