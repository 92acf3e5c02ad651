"""Sim mode of the checkpoint-recovery systems (reconstructed [R]: impl/ckpt_recovery/README.md,
"Sim").

One job = one system on one scenario (workload + fault); every storage profile in
``sim.storage_profiles`` is priced in the same job (``<metric>@<profile>``; headline at
``sim.storage``), because storage moves no layout and the re-plans are the costly part.

Per failure: T_lost = T_detect + T_restart + T_plan + T_load (+ UCP's conversion) + T_rework
(+ the wait for repair when no layout fits the survivors). Until the repair (2-6 h) the job
runs at ``throughput_kept`` = step time before / after; after it, a planned restart back to
the full layout (``t_rejoin_s``). ETTR = useful time / wall time:
- ``failures: fault`` (S1-S4): the scenario's loss recurring at the failure model's rate,
  ETTR = (1 - stall share) x (1 - (T_lost + T_repair (1 - kept) + T_rejoin) / MTBF).
- ``failures: poisson`` (S5, S6): seeded Poisson failures over ``days`` (58.7% one GPU, else
  a node; repair U(2, 6) h), the same traces for every system; the headline ETTR is the mean
  over ``trials`` (p10 / p90 over trials).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from faults.gpu_loss import LOSS_KINDS, lost_gpus, validate_loss
from impl.common.api import ConfigError, Metric, RunResult
from impl.common.parallel.cost import HybridCostModel, memory_model
from impl.common.parallel.plan import Plan
from impl.common.parallel.planner import PlannerConfig, check_uniform_fits
from impl.common.storage.emulator import PAPER_PROFILES, StorageProfile, paper_profile

from impl.ckpt_recovery.policies import POLICIES
from impl.ckpt_recovery.sim.cost import SaveCost, read_time_s, save_cost, write_time_s
from impl.ckpt_recovery.sim.checkpoint_io import CheckpointIO, LoadIO
from impl.ckpt_recovery.sim.layouts import after_loss, describe, rectangular, step_time_s
from impl.ckpt_recovery.sim import local as sim_local
from impl.ckpt_recovery.sim import peer as sim_peer


@dataclass(frozen=True)
class PolicyModel:
    granularity: str  # layouts.GRANULARITIES (sim/layouts.py)
    save: str  # overlapped | staged | sync (sim/cost.py)
    fmt: str  # splits | dcp | legacy | ucp (sim/checkpoint_io.py)
    ram_tier: bool = False  # Gemini-like: every-iteration copy in a buddy node's CPU memory
    plan_knob: str = "mesh_plan_s"


POLICY_MODELS = {
    "ckpt_recovery": PolicyModel("gpu_heterogeneous", "overlapped", "splits", plan_knob="plan_s"),
    "dcp_sync": PolicyModel("gpu_rectangular", "sync", "dcp"),
    "dcp_async": PolicyModel("gpu_rectangular", "staged", "dcp"),
    # the sim prices staging as the D2H copy whichever executor writes afterwards
    "dcp_async_process": PolicyModel("gpu_rectangular", "staged", "dcp"),
    "restart_all": PolicyModel("node_rectangular", "sync", "legacy"),
    "ucp_like": PolicyModel("gpu_rectangular", "sync", "ucp"),
    "gemini_like": PolicyModel("node_rectangular", "staged", "dcp", ram_tier=True),
}
RAM = PAPER_PROFILES["network"]
HOUR = 3600.0
TIER_CHOICES = ("fixed", "auto")


def planner_config(wl, hw, cm: HybridCostModel) -> PlannerConfig:
    levels = int(math.log2(wl.tp)) + 1
    alpha = tuple(wl.alpha) if wl.alpha else tuple(cm.alpha(levels))
    return PlannerConfig(num_gpus=wl.num_gpus, gpus_per_node=wl.gpus_per_node, dp=wl.dp, tp=wl.tp, pp=wl.pp,
                         num_layers=wl.model.num_layers, num_microbatches=wl.num_microbatches, alpha=alpha,
                         memory=memory_model(wl, hw), shrink_penalty=(1.0,) + (2.0,) * (levels - 1))


BASE_LAYOUTS = ("fastest", "nominal")


def base_plan(cfg: PlannerConfig, cm: HybridCostModel, how: str) -> Plan:
    """The healthy job's layout (``system.sim.base_layout``, see SimKnobs)."""
    if how not in BASE_LAYOUTS:
        raise ConfigError(f"system.sim.base_layout: unknown {how!r} (one of: {', '.join(BASE_LAYOUTS)})")
    nominal = cfg.uniform()
    if how == "nominal":
        return nominal
    best = rectangular(cfg, cm, (), whole_nodes=False)
    if best is not None and step_time_s(best, cm) < step_time_s(nominal, cm) - 1e-12:
        return best.with_label(f"fastest {best.label.split(' ', 1)[1]}")
    return nominal


def check_sim(system, wl, hw, fault) -> None:
    k = system.cfg.sim
    for name in [k.storage, *k.storage_profiles]:
        paper_profile(name)
    if k.failures not in ("fault", "poisson"):
        raise ConfigError(f"system.sim.failures: unknown {k.failures!r} (one of: fault, poisson)")
    if k.failures == "fault" and fault.kind not in LOSS_KINDS:
        raise ConfigError(f"fault.kind: sim.failures=fault needs a gpu_loss or node_loss fault, got {fault.kind!r}")
    if k.failures == "poisson" and fault.kind != "none":
        raise ConfigError(f"fault.kind: sim.failures=poisson draws its own failures; use fault=none, got {fault.kind!r}")
    if fault.kind in LOSS_KINDS:
        validate_loss(fault, wl.num_gpus, wl.gpus_per_node)
    tp = 1
    while tp <= wl.tp:
        if k.splits % tp:
            raise ConfigError(f"system.sim.splits: S={k.splits} is not divisible by TP degree {tp}")
        tp *= 2
    lo_hi = list(k.repair_h)
    if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1]:
        raise ConfigError(f"system.sim.repair_h: needs [lo, hi] hours with 0 < lo <= hi, got {lo_hi}")
    for name in ("failure_rate_per_gpu_h", "d2h_bytes_per_s", "days"):
        if not getattr(k, name) > 0:
            raise ConfigError(f"system.sim.{name}: must be > 0, got {getattr(k, name)}")
    if not 0 <= k.single_gpu_frac <= 1:
        raise ConfigError(f"system.sim.single_gpu_frac: must be in [0, 1], got {k.single_gpu_frac}")
    if k.trials < 1:
        raise ConfigError(f"system.sim.trials: must be >= 1, got {k.trials}")
    nodes = wl.num_gpus // wl.gpus_per_node
    elastor = POLICIES.get(system.cfg.policy).elastor
    if k.local_copies and (not elastor or not 0 < k.local_copies < nodes):
        raise ConfigError(f"system.sim.local_copies: needs policy ckpt_recovery and 0 <= k < {nodes} nodes, "
                          f"got k={k.local_copies} with policy {system.cfg.policy!r}")
    if k.local_copies < 0:
        raise ConfigError(f"system.sim.local_copies: must be >= 0, got {k.local_copies}")
    if k.peer_copies and (not elastor or not 0 < k.peer_copies < nodes or k.local_copies):
        raise ConfigError(f"system.sim.peer_copies: needs policy ckpt_recovery, no local_copies and 0 <= k < {nodes} "
                          f"nodes, got k={k.peer_copies} with policy {system.cfg.policy!r}, local_copies={k.local_copies}")
    if k.peer_copies < 0:
        raise ConfigError(f"system.sim.peer_copies: must be >= 0, got {k.peer_copies}")
    if k.tier_choice not in TIER_CHOICES:
        raise ConfigError(f"system.sim.tier_choice: unknown {k.tier_choice!r} (one of: {', '.join(TIER_CHOICES)})")
    if k.tier_choice == "auto" and (not elastor or k.local_copies or k.peer_copies < 1):
        raise ConfigError(f"system.sim.tier_choice: auto needs policy ckpt_recovery, peer_copies >= 1 (the peer "
                          f"candidate) and local_copies 0, got policy {system.cfg.policy!r}, "
                          f"peer_copies={k.peer_copies}, local_copies={k.local_copies}")
    if not 0 <= k.peer_correlated_frac <= 1:
        raise ConfigError(f"system.sim.peer_correlated_frac: must be in [0, 1], got {k.peer_correlated_frac}")
    for name in ("host_mem_bytes_per_node", "train_host_bytes_per_gpu"):
        if getattr(k, name) < 0:
            raise ConfigError(f"system.sim.{name}: must be >= 0, got {getattr(k, name)}")
    cm = HybridCostModel.build(wl, hw)
    pcfg = planner_config(wl, hw, cm)
    check_uniform_fits(pcfg.uniform(), pcfg)


class Scenario:
    """One workload's layouts, checkpoint I/O and per-profile costs, cached per lost set."""

    def __init__(self, policy: str, wl, hw, knobs, plans: Optional[dict] = None) -> None:
        """``plans``: another Scenario's re-plan cache (same policy and workload) to share."""
        self.policy, self.pm, self.k, self.wl = policy, POLICY_MODELS[policy], knobs, wl
        self.cm = HybridCostModel.build(wl, hw)
        self.pcfg = planner_config(wl, hw, self.cm)
        self.base = base_plan(self.pcfg, self.cm, knobs.base_layout)
        self.base_step_s = step_time_s(self.base, self.cm)
        self.io = CheckpointIO(wl.model, knobs.splits)
        self.mtbf_s = HOUR / (knobs.failure_rate_per_gpu_h * wl.num_gpus)
        self.rank_state = self.io.state_bytes / (self.base.tp * self.base.pipelines[0].num_stages)
        self.num_nodes = wl.num_gpus // wl.gpus_per_node
        self.local = knobs.local_copies if self.pm.fmt == "splits" else 0
        self.peer = knobs.peer_copies if self.pm.fmt == "splits" else 0
        if self.peer:
            # at run time, not in check_sim: a sweep's preflight would stop every other system's
            # job over this one's refusal; the job's record fails with this line instead
            sim_peer.check(self.io, self.base, self.peer, self.num_nodes, self.rank_state, knobs)
        self._plans: dict = {} if plans is None else plans
        self._memo: dict = {}

    # ---- layouts --------------------------------------------------------------------------
    def plan_after(self, lost) -> Optional[Plan]:
        key = tuple(sorted(lost))
        if not key:
            return self.base
        if key not in self._plans:
            p = after_loss(self.pm.granularity, self.pcfg, self.cm, key)
            if self.pm.granularity == "gpu_heterogeneous" and key:
                # a partition-agnostic checkpoint loads into any layout: keep the faster of the
                # heterogeneous plan and the best rectangular mesh (impl/ckpt_recovery/README.md, section "Sim")
                r = rectangular(self.pcfg, self.cm, key, whole_nodes=False)
                if r is not None and (p is None or step_time_s(r, self.cm) < step_time_s(p, self.cm) - 1e-12):
                    p = r
            self._plans[key] = p
        return self._plans[key]

    def kept(self, p: Optional[Plan]) -> float:
        return 0.0 if p is None else self.base_step_s / step_time_s(p, self.cm)

    # ---- saves ----------------------------------------------------------------------------
    def _save_io(self, fmt: str, plan: Plan):
        if fmt == "splits":
            return self.io.save_ours(plan)
        if fmt == "dcp":
            return self.io.save_dcp(plan)
        return self.io.save_legacy(plan)

    def save(self, prof: StorageProfile) -> SaveCost:
        """The persistent tier's checkpoints on ``prof`` (nominal layout)."""
        key = ("save", prof)
        if key not in self._memo:
            self._memo[key] = self._save(prof)
        return self._memo[key]

    def _save(self, prof: StorageProfile) -> SaveCost:
        staging = self.rank_state / self.k.d2h_bytes_per_s
        write = write_time_s(prof, self._save_io(self.pm.fmt, self.base), self.base)
        return save_cost(self.pm.save, staging, write, self.k.commit_calls * prof.latency_s, self.base_step_s,
                         self.mtbf_s, self.k.min_interval_s, after_commit_s=self.copy_s())

    def copy_s(self) -> float:
        """Commit -> the local copies written (0 without them)."""
        return sim_local.copy_time_s(self.io, self.base, self.local, self.num_nodes) if self.local else 0.0

    def ram_save(self) -> SaveCost:
        """Gemini-like: every iteration, a copy into a buddy node's CPU memory."""
        staging = self.rank_state / self.k.d2h_bytes_per_s
        write = write_time_s(RAM, self.io.save_dcp(self.base), self.base)
        return save_cost("overlapped", staging, write, 0.0, self.base_step_s, self.mtbf_s, 0.0,
                         fixed_interval_s=self.base_step_s)

    def peer_save(self) -> SaveCost:
        """The peer tier: every snapshot's files copied into k other hosts' memory (sim/peer.py)."""
        if "peer_save" not in self._memo:
            staging = self.rank_state / self.k.d2h_bytes_per_s
            self._memo["peer_save"] = sim_peer.peer_save(self.io, self.base, self.cm, self.peer, self.num_nodes,
                                                         staging, self.base_step_s, self.mtbf_s)
        return self._memo["peer_save"][0]

    def overhead(self, prof: StorageProfile) -> float:
        o = self.save(prof).overhead
        if self.pm.ram_tier:
            o = 1.0 - (1.0 - o) * (1.0 - self.ram_save().overhead)
        if self.peer:
            o = 1.0 - (1.0 - o) * (1.0 - self.peer_save().overhead)
        return o

    # ---- loads ----------------------------------------------------------------------------
    def load_io(self, fmt: str, saved: Plan, new: Plan) -> LoadIO:
        if fmt == "splits":
            return self.io.load_ours(saved, new)
        if fmt == "dcp":
            return self.io.load_dcp(saved, new)
        if fmt == "legacy":
            return self.io.load_legacy(saved, new)
        return self.io.load_ucp(new)

    def convert_s(self, prof: StorageProfile) -> float:
        """UCP-like: offline ds_to_universal on one node: read every file, write one fp32 file
        per parameter and moment."""
        if self.pm.fmt != "ucp":
            return 0.0
        saved = self.io.save_legacy(self.base)
        bw = prof.bandwidth_bytes_per_s * (self.wl.gpus_per_node if prof.scope == "rank" else 1)
        fp32 = sum(m.nbytes for m in self.io.metas if m.dtype == "float32")
        calls = len(saved.rank_bytes) + self.io.ucp_universal_files()
        return calls * prof.latency_s + ((self.io.state_bytes + fp32) / bw if bw else 0.0)

    def converts(self, saved: Plan, new: Plan) -> bool:
        """UCP-like converts only to change layout (same layout: DeepSpeed's own files)."""
        return self.pm.fmt == "ucp" and saved.signature() != new.signature()

    def load(self, prof: StorageProfile, saved: Plan, new: Plan, from_ram: bool = False,
             down_nodes: Optional[frozenset] = frozenset()) -> tuple[float, LoadIO]:
        """``down_nodes``: nodes whose local copies are gone (None: use no local copy)."""
        if self.local and not from_ram and down_nodes is not None:
            return self.local_load(prof, saved, new, down_nodes).t_s, self.io.load_ours(saved, new)
        if from_ram:
            io = self.io.load_dcp(saved, new)
            return read_time_s(RAM, io, new), io
        if self.pm.fmt == "ucp" and not self.converts(saved, new):
            io = self.io.load_legacy(saved, new)
            return read_time_s(prof, io, new), io
        io = self.load_io(self.pm.fmt, saved, new)
        return (self.convert_s(prof) if self.converts(saved, new) else 0.0) + read_time_s(prof, io, new), io

    def peer_load(self, saved: Plan, new: Plan, down_nodes: frozenset, copies_lost: bool = False) -> sim_peer.PeerLoad:
        key = ("peer_load", saved.signature(), new.signature(), down_nodes, copies_lost)
        if key not in self._memo:
            self._memo[key] = sim_peer.load(self.io, saved, new, self.peer, self.num_nodes, down_nodes, copies_lost)
        return self._memo[key]

    def reload_s(self, prof: StorageProfile, new: Plan, down_nodes: frozenset) -> float:
        """Back from an idle wait: the full layout's newest checkpoint into ``new``."""
        t_storage = self.load(prof, self.base, new, from_ram=self.pm.ram_tier, down_nodes=None)[0]
        if self.peer:
            pl = self.peer_load(self.base, new, down_nodes)
            if pl.from_peers:
                return min(pl.t_s, t_storage)
        return t_storage

    def local_load(self, prof: StorageProfile, saved: Plan, new: Plan, down_nodes: frozenset) -> sim_local.LocalLoad:
        key = ("local_load", prof, saved.signature(), new.signature(), down_nodes)
        if key not in self._memo:
            self._memo[key] = sim_local.load(self.io, prof, saved, new, self.local, self.num_nodes, down_nodes)
        return self._memo[key]

    # ---- one failure ------------------------------------------------------------------------
    def failure(self, prof: StorageProfile, lost, mid_save: bool, repair_s: float, ram_lost: bool = False,
                down_nodes: frozenset = frozenset(), copies_lost: bool = False) -> dict:
        """Costs of one loss of ``lost`` GPUs from the full layout (seconds); ``down_nodes``: the
        dead nodes (their local / peer copies are gone); ``copies_lost``: a correlated loss took
        every copy of the files a dead node held (peer copies only)."""
        down_nodes = frozenset(down_nodes) if self.local or self.peer else frozenset()
        copies_lost = bool(copies_lost and self.peer and down_nodes)
        key = ("failure", prof, tuple(sorted(lost)), mid_save, repair_s, ram_lost, down_nodes, copies_lost)
        if key not in self._memo:
            self._memo[key] = self._failure(prof, lost, mid_save, repair_s, ram_lost, down_nodes, copies_lost)
        return dict(self._memo[key])

    def _failure(self, prof: StorageProfile, lost, mid_save: bool, repair_s: float, ram_lost: bool,
                 down_nodes: frozenset = frozenset(), copies_lost: bool = False) -> dict:
        k = self.k
        new = self.plan_after(lost)
        ram = self.pm.ram_tier and not ram_lost
        target = new if new is not None else self.base  # idle: reload the same layout after repair
        pl = self.peer_load(self.base, target, down_nodes, copies_lost) if self.peer else None
        sv = self.ram_save() if ram else self.save(prof)
        t_load, io = self.load(prof, self.base, target, from_ram=ram, down_nodes=down_nodes)
        # the loader knows both tiers' newest steps: it takes the peer commit unless the storage
        # one costs less in load + rework (a store as fast as peer RAM, a fresh storage commit)
        use_peer = pl is not None and pl.from_peers and (
            pl.t_s + self.peer_save().rework_s(mid_save) <= t_load + sv.rework_s(mid_save))
        if use_peer:
            sv, t_load = self.peer_save(), pl.t_s
        plan_s = getattr(k, self.pm.plan_knob)
        out = {"t_detect_s": k.detect_s, "t_restart_s": k.restart_s, "t_plan_s": plan_s, "t_rework_s": sv.rework_s(mid_save),
               "t_convert_s": self.convert_s(prof) if not ram and self.converts(self.base, target) else 0.0}
        if pl is not None:
            every = float(pl.peer_slices + pl.storage_slices)
            out.update({"peer_slices": every if use_peer else 0.0, "storage_slices": 0.0 if use_peer else every,
                        "lost_copy_files": float(pl.lost_files), "loaded_from_peers": float(use_peer)})
        out["t_load_s"] = t_load - out["t_convert_s"]
        if self.local:
            ll = self.local_load(prof, self.base, target, down_nodes)
            out["t_copy_s"] = self.copy_s()
            out["storage_read_share"] = ll.storage_bytes / max(ll.storage_bytes + ll.copy_bytes, 1.0)
        out["read_calls"] = float(io.max_calls())
        out["read_bytes_ratio"] = io.read_ratio()
        out["t_idle_s"] = repair_s if new is None else 0.0
        out["t_lost_s"] = (out["t_detect_s"] + out["t_restart_s"] + out["t_plan_s"] + out["t_convert_s"] + out["t_load_s"]
                           + out["t_rework_s"] + out["t_idle_s"])
        kept = self.kept(new)
        out["throughput_kept"] = kept
        out["gpus_used"] = float(len(new.active_gpus)) if new is not None else 0.0
        out["t_degraded_s"] = repair_s * (1.0 - kept) if new is not None else 0.0
        out["t_rejoin_s"] = self.rejoin_s(prof, new) if new is not None else 0.0
        return out

    def rejoin_s(self, prof: StorageProfile, new: Optional[Plan]) -> float:
        """Planned return to the full layout after the repair: wait for a committed save,
        restart, plan, load the degraded layout's checkpoint into the full one."""
        if new is None or new.signature() == self.base.signature():
            return 0.0
        sv = self.ram_save() if self.pm.ram_tier else self.save(prof)
        t_load, _ = self.load(prof, new, self.base, from_ram=self.pm.ram_tier)
        if self.peer:  # every node back: the degraded layout's newest peer or storage commit
            ps, t_peer = self.peer_save(), self.peer_load(new, self.base, frozenset()).t_s
            if ps.stall_s + ps.lag_s + t_peer <= sv.stall_s + sv.lag_s + t_load:
                sv, t_load = ps, t_peer
        return sv.stall_s + sv.lag_s + self.k.restart_s + getattr(self.k, self.pm.plan_knob) + t_load


# ---- S1-S4: the fault's loss at the failure model's rate ------------------------------------

def fault_metrics(sc: Scenario, fault, prof: StorageProfile) -> dict:
    k = sc.k
    repair_s = HOUR * (k.repair_h[0] + k.repair_h[1]) / 2.0
    lost = lost_gpus(fault, sc.wl.gpus_per_node)
    down = frozenset([fault.node]) if fault.kind == "node_loss" else frozenset()
    per_failure, f, g = per_failure_cost(sc, prof, lost, repair_s, fault.mid_save, down)
    sv = sc.save(prof)
    out = dict(f)
    if g is not None:
        out.update({"t_lost_correlated_s": g["t_lost_s"], "storage_slices_correlated": g["storage_slices"]})
    if sc.peer:
        out.update(peer_info(sc))
    out.update({"t_stall_s": sv.stall_s, "t_commit_s": sv.lag_s, "interval_s": sv.interval_s,
                "ckpt_overhead": sc.overhead(prof), "mtbf_h": sc.mtbf_s / HOUR,
                "ettr": (1.0 - sc.overhead(prof)) * max(0.0, 1.0 - per_failure / sc.mtbf_s)})
    return out


# ---- S5, S6: seeded Poisson failures ------------------------------------------------------------

@dataclass(frozen=True)
class FailureEvent:
    t_s: float
    gpus: tuple[int, ...]
    node: Optional[int]  # the node of a node failure
    repair_s: float


def failure_trace(num_gpus: int, gpus_per_node: int, knobs, seed: int) -> list[FailureEvent]:
    """Poisson failures at rate lambda x alive GPUs over ``days`` (repairs bring GPUs back)."""
    rng = np.random.default_rng(seed)
    horizon = knobs.days * 24 * HOUR
    lam = knobs.failure_rate_per_gpu_h / HOUR
    down: dict[int, float] = {}  # gpu -> repaired at
    t, out = 0.0, []
    while True:
        alive = [g for g in range(num_gpus) if down.get(g, -1.0) <= t]
        t += float(rng.exponential(1.0 / (lam * len(alive))))
        if t >= horizon:
            return out
        alive = [g for g in range(num_gpus) if down.get(g, -1.0) <= t]
        repair = HOUR * float(rng.uniform(knobs.repair_h[0], knobs.repair_h[1]))
        if rng.random() < knobs.single_gpu_frac:
            gpus, node = (alive[int(rng.integers(len(alive)))],), None
        else:
            nodes = sorted({g // gpus_per_node for g in alive})
            node = nodes[int(rng.integers(len(nodes)))]
            gpus = tuple(g for g in alive if g // gpus_per_node == node)
        for g in gpus:
            down[g] = t + repair
        out.append(FailureEvent(t, gpus, node, repair))


def canonical(lost, num_gpus: int, gpn: int) -> tuple[int, ...]:
    """A representative lost set: the most damaged nodes last, dead GPUs at their top ids
    (layouts and costs depend on how many GPUs each node lost, not on which)."""
    per: dict[int, int] = {}
    for g in lost:
        per[g // gpn] = per.get(g // gpn, 0) + 1
    counts = sorted(per.values())
    nodes = num_gpus // gpn
    out = []
    for i, c in enumerate(counts):
        n = nodes - len(counts) + i
        out += range((n + 1) * gpn - c, (n + 1) * gpn)
    return tuple(sorted(out))


def peer_info(sc: Scenario) -> dict:
    ps = sc.peer_save()
    _, wire, f = sc._memo["peer_save"]
    mem = max(h.total for h in sim_peer.host_memory(sc.io, sc.base, sc.peer, sc.num_nodes, sc.rank_state, sc.k))
    return {"t_peer_stall_s": ps.stall_s, "t_peer_lag_s": ps.lag_s, "peer_interval_s": ps.interval_s,
            "t_copy_s": wire, "net_busy_frac": f, "host_mem_bytes": mem}


def run_trace(sc: Scenario, prof: StorageProfile, events: list[FailureEvent], horizon_s: float,
              rng: Optional[np.random.Generator] = None) -> dict:
    """Useful time of one system over one trace. Downtime (detect, restart, load, rework,
    rejoin) and idle waits run at rate 0; otherwise the layout of the current lost set at its
    throughput, less the checkpoint stall share."""
    gpn, N = sc.wl.gpus_per_node, sc.wl.num_gpus
    eff = 1.0 - sc.overhead(prof)
    changes = []  # (time, +1 fail / -1 repair, event)
    for e in events:
        changes.append((e.t_s, 1, e))
        if e.t_s + e.repair_s < horizon_s:
            changes.append((e.t_s + e.repair_s, -1, e))
    changes.sort(key=lambda c: (c[0], -c[1]))
    lost: set = set()
    node_down: set = set()
    avail_at, t_prev, work, rate = 0.0, 0.0, 0.0, 1.0
    cur: Optional[Plan] = sc.base
    lost_per_failure = []
    storage_slices, fallbacks = 0.0, 0
    for t, kind, e in changes:
        work += rate * eff * max(0.0, t - max(t_prev, avail_at))
        t_prev = t
        if kind == 1:
            ram_lost = sc.pm.ram_tier and e.node is not None and (e.node ^ 1) in node_down
            lost |= set(e.gpus)
            if e.node is not None:
                node_down.add(e.node)
            key = canonical(lost, N, gpn)
            new = sc.plan_after(key)
            # one draw per node failure whatever the system, so every profile sees the same ones
            corr = e.node is not None and rng is not None and float(rng.random()) < sc.k.peer_correlated_frac
            f = sc.failure(prof, key, False, 0.0, ram_lost=ram_lost, down_nodes=frozenset(node_down), copies_lost=corr)
            storage_slices += f.get("storage_slices", 0.0)
            fallbacks += int(f.get("loaded_from_peers", 1.0) == 0.0)
            down = f["t_detect_s"] + f["t_rework_s"] + (f["t_restart_s"] + f["t_plan_s"] + f["t_convert_s"] + f["t_load_s"]
                                                       if new is not None else 0.0)
            lost_per_failure.append(f["t_lost_s"] - f["t_idle_s"] + (e.repair_s if new is None else 0.0))
        else:
            lost -= set(e.gpus)
            node_down.discard(e.node)
            new = sc.plan_after(canonical(lost, N, gpn))
            if new is None:
                down = 0.0
            elif cur is None:  # back from idle: restart and reload (storage, or peer memory)
                t_load = sc.reload_s(prof, new, frozenset(node_down))
                down = sc.k.restart_s + getattr(sc.k, sc.pm.plan_knob) + t_load
            elif lost:  # still degraded: keep the running layout until every GPU is back
                new, down = cur, 0.0
            else:
                down = sc.rejoin_s(prof, cur)
        avail_at = max(avail_at, t) + down
        cur = new
        rate = sc.kept(new)
    work += rate * eff * max(0.0, horizon_s - max(t_prev, avail_at))
    return {"ettr": work / horizon_s, "failures": float(len(events)), "lost": lost_per_failure,
            "storage_slices": storage_slices, "peer_fallbacks": float(fallbacks)}


def poisson_metrics(sc: Scenario, prof: StorageProfile, seed: int) -> dict:
    k = sc.k
    horizon = k.days * 24 * HOUR
    ettrs, fails, lost, sslices, fallbacks = [], [], [], [], []
    for trial in range(k.trials):
        ev = failure_trace(sc.wl.num_gpus, sc.wl.gpus_per_node, k, seed * 1000003 + trial)
        rng = np.random.default_rng([seed * 1000003 + trial, 27]) if sc.peer else None  # correlated losses
        r = run_trace(sc, prof, ev, horizon, rng)
        ettrs.append(r["ettr"])
        fails.append(r["failures"])
        lost += r["lost"]
        sslices.append(r["storage_slices"])
        fallbacks.append(r["peer_fallbacks"])
    (one_lost, _), (node_lost, node_down) = typical_losses(sc)
    one = sc.failure(prof, one_lost, False, 0.0)
    node = sc.failure(prof, node_lost, False, 0.0, down_nodes=node_down)
    sv = sc.save(prof)
    return {"ettr_samples": ettrs, "failures_per_trial": statistics.fmean(fails),
            "t_lost_s": statistics.fmean(lost) if lost else 0.0,
            "t_stall_s": sv.stall_s, "t_commit_s": sv.lag_s, "interval_s": sv.interval_s,
            "t_load_s": one["t_load_s"], "read_calls": one["read_calls"], "read_bytes_ratio": one["read_bytes_ratio"],
            "t_rework_s": one["t_rework_s"], "t_convert_s": one["t_convert_s"],
            "throughput_kept": one["throughput_kept"], "throughput_kept_node": node["throughput_kept"],
            "ckpt_overhead": sc.overhead(prof), "mtbf_h": sc.mtbf_s / HOUR,
            **({"t_copy_s": one["t_copy_s"], "storage_read_share": one["storage_read_share"],
                "t_load_node_s": node["t_load_s"], "storage_read_share_node": node["storage_read_share"]}
               if sc.local else {}),
            **({**peer_info(sc), "t_load_node_s": node["t_load_s"], "peer_slices": one["peer_slices"],
                "storage_slices": statistics.fmean(sslices), "peer_fallbacks": statistics.fmean(fallbacks)}
               if sc.peer else {})}


UNITS = {"ettr": ("fraction", "higher"), "throughput_kept": ("fraction", "higher"),
         "throughput_kept_node": ("fraction", "higher"), "gpus_used": ("GPUs", "higher"),
         "read_calls": ("calls", "lower"), "read_bytes_ratio": ("x", "lower"), "ckpt_overhead": ("fraction", "lower"),
         "mtbf_h": ("h", "higher"), "failures_per_trial": ("failures", "lower"),
         "storage_read_share": ("fraction", "lower"), "storage_read_share_node": ("fraction", "lower"),
         "peer_slices": ("slices", "higher"), "storage_slices": ("slices", "lower"),
         "storage_slices_correlated": ("slices", "lower"), "lost_copy_files": ("files", "lower"),
         "peer_fallbacks": ("failures", "lower"), "loaded_from_peers": ("fraction", "higher"), "net_busy_frac": ("fraction", "lower"),
         "host_mem_bytes": ("bytes", "lower")}
PER_PROFILE = ("t_stall_s", "t_commit_s", "interval_s", "t_load_s", "t_convert_s", "t_rework_s", "t_lost_s", "ettr",
               "storage_read_share", "t_load_node_s", "storage_slices", "peer_fallbacks")


def _metric(name: str, v) -> Metric:
    unit, better = UNITS.get(name, ("s", "lower"))
    if isinstance(v, list):  # a per-trial sample: the mean is the headline (7-day ETTR expectation)
        vals = sorted(v)
        base = Metric.from_samples(vals, unit, better)
        return replace(base, value=statistics.fmean(vals))
    return Metric.scalar(v, unit, better)


def per_failure_cost(sc: Scenario, prof: StorageProfile, lost, repair_s: float, mid_save: bool,
                     down: frozenset) -> tuple[float, dict, Optional[dict]]:
    """Expected T_lost + T_degraded + T_rejoin of one loss (over the correlated share for a
    node loss with peer copies), the failure's costs, and the correlated failure's (or None)."""
    f = sc.failure(prof, lost, mid_save, repair_s, down_nodes=down)
    cost = f["t_lost_s"] + f["t_degraded_s"] + f["t_rejoin_s"]
    c = sc.k.peer_correlated_frac if sc.peer and down else 0.0
    if not c:
        return cost, f, None
    g = sc.failure(prof, lost, mid_save, repair_s, down_nodes=down, copies_lost=True)
    return (1.0 - c) * cost + c * (g["t_lost_s"] + g["t_degraded_s"] + g["t_rejoin_s"]), f, g


def typical_losses(sc: Scenario) -> tuple[tuple[tuple, frozenset], tuple[tuple, frozenset]]:
    """(lost GPUs, dead nodes) of the failure model's two kinds: one GPU, and one whole node
    (canonical sets: the damaged node last)."""
    gpn, N = sc.wl.gpus_per_node, sc.wl.num_gpus
    return (canonical([0], N, gpn), frozenset()), (canonical(range(gpn), N, gpn), frozenset([N // gpn - 1]))


def predicted_ettr(sc: Scenario, prof: StorageProfile) -> float:
    """What the system can know before any failure: the S1-S4 ETTR formula over the failure
    model's mix (one GPU with probability single_gpu_frac, else a whole node; mean repair;
    a loss at a uniform phase), not over the scenario's own fault."""
    k = sc.k
    repair_s = HOUR * (k.repair_h[0] + k.repair_h[1]) / 2.0
    (one_lost, _), (node_lost, node_down) = typical_losses(sc)
    one = per_failure_cost(sc, prof, one_lost, repair_s, False, frozenset())[0]
    node = per_failure_cost(sc, prof, node_lost, repair_s, False, node_down)[0]
    expected = k.single_gpu_frac * one + (1.0 - k.single_gpu_frac) * node
    return (1.0 - sc.overhead(prof)) * max(0.0, 1.0 - expected / sc.mtbf_s)


def tier_candidates(policy: str, wl, hw, knobs) -> tuple[list[tuple[str, Scenario]], dict[str, str]]:
    """tier_choice=auto: storage alone, local copies (k=1), peer copies (k=peer_copies), in that
    order (a tie keeps the earlier, simpler one); a tier that cannot run here is left out with
    its one-line reason (e.g. peer copies that do not fit in host memory)."""
    nodes = wl.num_gpus // wl.gpus_per_node
    want = [("storage only", 0, 0), ("local copies k=1", 0, 1), (f"peer copies k={knobs.peer_copies}", knobs.peer_copies, 0)]
    out, refused, plans = [], {}, {}
    for label, peer, local in want:
        if local and not local < nodes:
            refused[label] = f"needs >= 2 nodes, the job has {nodes}"
            continue
        try:
            # same policy and workload: one re-plan per lost set for every candidate
            sc = Scenario(policy, wl, hw, replace(knobs, peer_copies=peer, local_copies=local, tier_choice="fixed"),
                          plans=plans)
        except ConfigError as exc:
            refused[label] = str(exc)
            continue
        out.append((label, sc))
    return out, refused


def run_sim(system, job) -> RunResult:
    k = system.cfg.sim
    profiles = list(dict.fromkeys([k.storage, *k.storage_profiles]))
    if k.tier_choice == "auto":
        cands, refused = tier_candidates(system.cfg.policy, job.workload, job.hardware, k)
        if not cands:
            raise ConfigError(f"system.sim.tier_choice: no tier set can run here: {refused}")
        chosen, tiers = {}, {}
        for name in profiles:
            prof = paper_profile(name)
            pred = [(label, predicted_ettr(c, prof)) for label, c in cands]
            best = max(range(len(pred)), key=lambda i: (pred[i][1], -i))
            chosen[name] = cands[best][1]
            tiers[name] = {"chosen": pred[best][0], "predicted_ettr": dict(pred), "refused": refused}
    else:
        fixed = Scenario(system.cfg.policy, job.workload, job.hardware, k)
        chosen, tiers = {name: fixed for name in profiles}, None
    per: dict[str, dict] = {}
    for name in profiles:
        prof = paper_profile(name)
        sc = chosen[name]
        per[name] = fault_metrics(sc, job.fault, prof) if k.failures == "fault" else poisson_metrics(sc, prof, job.seed)
    sc = chosen[k.storage]
    head = per[k.storage]
    metrics = {}
    for m, v in head.items():
        metrics["ettr" if m == "ettr_samples" else m] = _metric("ettr" if m == "ettr_samples" else m, v)
    for name, vals in per.items():
        for m in PER_PROFILE:
            src = "ettr_samples" if m == "ettr" and "ettr_samples" in vals else m
            if src in vals:
                metrics[f"{m}@{name}"] = _metric(m, vals[src])
    info = {"policy": system.cfg.policy, "granularity": sc.pm.granularity, "save": sc.pm.save, "format": sc.pm.fmt,
            "storage": k.storage, "storage_profiles": list(per), "failures": k.failures,
            "state_bytes": sc.io.state_bytes, "base_step_s": sc.base_step_s, "base_layout": f"{sc.base.label}: {describe(sc.base)}",
            "reconstructed": "inputs tagged [R] in impl/ckpt_recovery/README.md, section Sim"}
    if sc.local:
        info["local_copies"] = sc.local
    if sc.peer:
        info["peer_copies"] = sc.peer
    if tiers is not None:
        info["tier_choice"] = tiers
    if k.failures == "fault":
        lost = lost_gpus(job.fault, job.workload.gpus_per_node)
        info["lost_gpus"] = list(lost)
        info["layout_after"] = describe(sc.plan_after(lost))
    return RunResult(metrics=metrics, info=info)
