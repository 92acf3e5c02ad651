"""Malleus's planner: the six steps of spec malleus 2.3 over per-GPU straggling rates.

1. TP groups per node (:func:`node_groups`): healthy GPUs by id, then stragglers by rate; the
   first groups are full (tp GPUs), the last window of tp slots is split into descending
   powers of two from each start size h0, scored by sum 1/(alpha_k * y * w_k) (w_0 = 1,
   w_k = ``shrink_penalty`` for shrunk groups); GPUs left over are suspended. With >= 2
   stragglers in a node, the window also slides left (shifted orders).
2. Stage-count vectors (:func:`stage_vectors`).
3. Templates (:func:`templates`): DFS puts the non-placeholder groups (y descending) on the
   leading stages of pipelines; pipelines of equal depth are interchangeable, so a group only
   goes to the first of several identical-so-far pipelines, and templates are ordered
   canonically (more stragglers first; on a tie the larger first rate first).
4. ILP-A per pipeline and ILP-B per template (:mod:`impl.malleus.ilp`); infeasible templates
   are dropped; the top k by Z are kept, ties by enumeration order.
5. Placeholders get real healthy groups: pass 1 fills the stage columns of pipeline 0's
   straggler stages from the straggler's node; pass 2 the rest by the best IoU of the group's
   old layer range (so migration can reuse state in place).
6. A :class:`~impl.common.parallel.plan.Plan`; groups with no layers are suspended.

The top-k plans are then re-scored with the full cost model (fill bubbles and communication,
which Z ignores) when a ``cost_fn`` is given; the result keeps every candidate for reports.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from impl.common.api import ConfigError
from impl.common.parallel.plan import (HEALTHY_BELOW, Group, Plan, PipelinePlan, effective_rate, plan_z,
                                       uniform_plan, validate_plan)

from .ilp import ilp_a, ilp_b


@dataclass(frozen=True)
class PlannerConfig:
    num_gpus: int
    gpus_per_node: int
    dp: int
    tp: int
    pp: int
    num_layers: int
    num_microbatches: int
    alpha: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    memory: object = None  # impl.common.parallel.cost.MemoryModel or None
    top_k: int = 5
    shrink_penalty: float = 2.0
    healthy_below: float = HEALTHY_BELOW
    solver_a: str = "cbc"
    solver_b: str = "highs"
    # Bounds on the search (the reference code has none; they only bite at >= 512 GPUs).
    max_stage_vectors: int = 16
    max_templates: int = 4000

    def __post_init__(self) -> None:
        if self.num_gpus % self.gpus_per_node:
            raise ConfigError(f"workload.num_gpus: {self.num_gpus} is not a multiple of gpus_per_node {self.gpus_per_node}")
        if self.dp * self.tp * self.pp != self.num_gpus:
            raise ConfigError(f"workload: dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.dp * self.tp * self.pp} "
                              f"!= num_gpus {self.num_gpus}")
        if self.tp > self.gpus_per_node or self.gpus_per_node % self.tp or self.tp & (self.tp - 1):
            raise ConfigError(f"workload.tp: {self.tp} must be a power of two dividing gpus_per_node {self.gpus_per_node}")
        levels = int(math.log2(self.tp)) + 1
        if len(self.alpha) < levels:
            raise ConfigError(f"workload.alpha: tp={self.tp} needs {levels} entries (k = 0..{levels - 1}), got {list(self.alpha)}")

    @property
    def num_nodes(self) -> int:
        return self.num_gpus // self.gpus_per_node

    def uniform(self) -> Plan:
        return uniform_plan(self.num_gpus, self.gpus_per_node, self.dp, self.tp, self.pp, self.num_layers,
                            self.num_microbatches)


@dataclass(frozen=True)
class Candidate:
    z: float
    plan: Plan
    cost_s: Optional[float] = None


@dataclass
class PlanResult:
    plan: Plan
    z: float
    group_y: list[float]  # planner's rate per group of ``plan`` (hysteresis applied)
    candidates: list[Candidate] = field(default_factory=list)  # top-k by Z, in Z order
    stats: dict = field(default_factory=dict)


def check_node_limits(x: Sequence[float], gpus_per_node: int, tp: int, healthy_below: float = HEALTHY_BELOW) -> None:
    """Spec 8 (code limits): only the last tp slots of a node are regrouped, so a node may hold
    at most tp-1 stragglers, or be slow as a whole (its groups then stay full)."""
    for n in range(len(x) // gpus_per_node):
        ids = range(n * gpus_per_node, (n + 1) * gpus_per_node)
        slow = [g for g in ids if effective_rate(x[g], healthy_below) > 1.0]
        if tp - 1 < len(slow) < gpus_per_node:
            raise ConfigError(f"fault.gpus: node {n} has {len(slow)} straggling GPUs {slow}, more than a node allows "
                              f"(at most tp-1 = {tp - 1}, or all {gpus_per_node} GPUs of the node)")


def check_uniform_fits(plan: Plan, cfg: "PlannerConfig") -> None:
    """Bad input: the nominal layout itself must fit device memory."""
    if cfg.memory is None:
        return
    for p in plan.pipelines:
        for j, n in enumerate(p.layers):
            if not cfg.memory.fits(p.num_stages, j, n, 1.0):
                need = cfg.memory.stage_mb(p.num_stages, j, n, 1.0)
                raise ConfigError(f"workload.memory: the nominal layout does not fit: stage {j} holds {n} layers "
                                  f"and needs {need:.0f} MB > capacity {cfg.memory.capacity_mb:.0f} MB "
                                  f"(dp={cfg.dp} tp={cfg.tp} pp={cfg.pp})")


# ---------------------------------------------------------------------------------------
# step 1
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _G:
    """A planned group before placement: GPUs, node, shrink level k, rate y."""

    gpus: tuple[int, ...]
    node: int
    k: int
    y: float


def _rate(xs: Sequence[float], k: int, cfg: PlannerConfig) -> float:
    return effective_rate(cfg.alpha[k] * max(xs), cfg.healthy_below)


def node_groups(node: int, x: Sequence[float], cfg: PlannerConfig) -> tuple[list[_G], list[int]]:
    """Groups and suspended GPUs of one node (step 1)."""
    gpn, tp = cfg.gpus_per_node, cfg.tp
    ids = list(range(node * gpn, (node + 1) * gpn))
    xe = {g: effective_rate(x[g], cfg.healthy_below) for g in ids}
    healthy = [g for g in ids if xe[g] == 1.0]
    strag = sorted((g for g in ids if xe[g] > 1.0), key=lambda g: (x[g], g))
    order = healthy + strag
    per_node = gpn // tp
    if not strag:
        return [_G(tuple(order[i * tp:(i + 1) * tp]), node, 0, 1.0) for i in range(per_node)], []
    fulls = range(per_node - 1, -1, -1) if len(strag) >= 2 else [per_node - 1]
    best, best_key = None, None
    for n_full in fulls:
        groups = [_G(tuple(order[i * tp:(i + 1) * tp]), node, 0, _rate([x[g] for g in order[i * tp:(i + 1) * tp]], 0, cfg))
                  for i in range(n_full)]
        window = order[n_full * tp:(n_full + 1) * tp]
        h0 = tp
        while h0 >= 1:
            split, pos, size, k = [], 0, h0, int(round(math.log2(tp // h0)))
            while size >= 1 and pos + size <= len(window):
                gpus = tuple(window[pos:pos + size])
                split.append(_G(gpus, node, k, _rate([x[g] for g in gpus], k, cfg)))
                pos += size
                size //= 2
                k += 1
            cand = groups + split
            used = {g for grp in cand for g in grp.gpus}
            score = math.fsum(1.0 / (grp.y * (1.0 if grp.k == 0 else cfg.shrink_penalty)) for grp in cand)
            key = round(score, 12)
            if best_key is None or key > best_key:
                best, best_key = (cand, sorted(set(ids) - used)), key
            h0 //= 2
    return best


def all_groups(x: Sequence[float], cfg: PlannerConfig) -> tuple[list[_G], list[int]]:
    groups, suspended = [], []
    for n in range(cfg.num_nodes):
        g, s = node_groups(n, x, cfg)
        groups += g
        suspended += s
    return groups, suspended


# ---------------------------------------------------------------------------------------
# step 2
# ---------------------------------------------------------------------------------------


def stage_vectors(num_groups: int, cfg: PlannerConfig) -> list[tuple[int, ...]]:
    """Non-increasing stage counts per pipeline summing to the group count."""
    D = cfg.dp
    if num_groups == D * cfg.pp:
        return [(cfg.pp,) * D]
    base, rem = divmod(num_groups, D)
    lo, hi = max(1, base - 1), min(base + rem + 1, cfg.num_layers)
    out: list[tuple[int, ...]] = []

    def rec(prefix: list[int], left: int, cap: int) -> None:
        if len(out) >= 100_000:
            return
        i = len(prefix)
        if i == D:
            if left == 0:
                out.append(tuple(prefix))
            return
        slots = D - i
        for v in range(min(cap, hi), lo - 1, -1):
            rest = left - v
            if rest < lo * (slots - 1) or rest > min(v, hi) * (slots - 1):
                continue
            rec(prefix + [v], rest, v)

    rec([], num_groups, hi)
    out = [v for v in out if sum(v) <= cfg.num_microbatches]
    # closest to uniform first, so a bound on their number keeps the balanced ones
    out.sort(key=lambda v: (max(v) - min(v), tuple(-s for s in v)))
    return out[:cfg.max_stage_vectors]


# ---------------------------------------------------------------------------------------
# step 3
# ---------------------------------------------------------------------------------------


def templates(specials: Sequence[_G], svec: Sequence[int], limit: int) -> list[list[list[int]]]:
    """Assignments of special groups (indices into ``specials``, sorted by y descending) to
    pipelines: ``t[i]`` = the special groups on the leading stages of pipeline i, in order."""
    D = len(svec)
    out: list[list[list[int]]] = []
    seen: set = set()
    cur: list[list[int]] = [[] for _ in range(D)]

    def sig(i: int) -> tuple:
        return (svec[i], tuple((specials[s].y, specials[s].k) for s in cur[i]))

    def rec(s: int) -> None:
        if len(out) >= limit:
            return
        if s == len(specials):
            canon = _canonical(cur, svec, specials)
            key = tuple(tuple((specials[g].y, specials[g].k) for g in p) for p in canon)
            if key not in seen:
                seen.add(key)
                out.append([list(p) for p in canon])
            return
        tried: set = set()
        for i in range(D):
            if len(cur[i]) >= svec[i]:
                continue
            k = sig(i)
            if k in tried:  # an identical pipeline already took this group
                continue
            tried.add(k)
            cur[i].append(s)
            rec(s + 1)
            cur[i].pop()

    rec(0)
    return out


def _canonical(cur, svec, specials):
    """Within each run of equal depth: more specials first, then larger rates first."""
    out = [list(p) for p in cur]
    i = 0
    while i < len(svec):
        j = i
        while j < len(svec) and svec[j] == svec[i]:
            j += 1
        block = sorted(out[i:j], key=lambda p: (-len(p), [-specials[g].y for g in p], [specials[g].k for g in p]))
        out[i:j] = block
        i = j
    return out


# ---------------------------------------------------------------------------------------
# steps 4-6
# ---------------------------------------------------------------------------------------


def _iou(a: tuple[int, int], b: tuple[int, int]) -> float:
    inter = max(0, min(a[1], b[1]) - max(a[0], b[0]))
    union = max(a[1], b[1]) - min(a[0], b[0])
    return inter / union if union > 0 else 0.0


def plan(cfg: PlannerConfig, x: Sequence[float], old_plan: Optional[Plan] = None,
         cost_fn: Optional[Callable[[Plan], float]] = None) -> PlanResult:
    """The best plan for per-GPU rates ``x`` (len = num_gpus)."""
    if len(x) != cfg.num_gpus:
        raise ConfigError(f"straggling rates: got {len(x)} for {cfg.num_gpus} GPUs")
    for g, v in enumerate(x):
        if not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"straggling rate of GPU {g} must be a positive finite number, got {v}")
    groups, suspended = all_groups(x, cfg)
    specials = sorted([g for g in groups if not (g.k == 0 and g.y == 1.0)], key=lambda g: (-g.y, g.k, g.gpus))
    healthy = [g for g in groups if g.k == 0 and g.y == 1.0]
    svecs = stage_vectors(len(groups), cfg)
    if not svecs:
        raise ConfigError(f"planner: {len(groups)} TP groups cannot form {cfg.dp} pipelines for "
                          f"{cfg.num_microbatches} micro-batches and {cfg.num_layers} layers")
    a_cache: dict = {}
    b_cache: dict = {}
    # (rank key, Z, svec, template, (layers, m)); the key breaks ties of Z (README): fewer
    # pipelines holding stragglers, then the bubble-inclusive bound max_i (m_i + S_i - 1) z_i,
    # then enumeration order.
    ranked: list[tuple[tuple, float, tuple, list, list]] = []
    n_templates = 0
    order = 0
    for svec in svecs:
        for tmpl in templates(specials, svec, cfg.max_templates):
            n_templates += 1
            zs, layers_all = [], []
            for i, S in enumerate(svec):
                spec = tuple((specials[s].y, cfg.tp / len(specials[s].gpus)) for s in tmpl[i])
                spec += ((1.0, 1.0),) * (S - len(tmpl[i]))
                if spec not in a_cache:
                    a_cache[spec] = ilp_a([s[0] for s in spec], [s[1] for s in spec], cfg.num_layers,
                                          cfg.memory, cfg.solver_a)
                res = a_cache[spec]
                if res is None:
                    break
                zs.append(res[0])
                layers_all.append(res[1])
            else:
                # continuous lower bound of ILP-B: skip templates that cannot enter the top k
                lb = cfg.num_microbatches / math.fsum(1.0 / z for z in zs)
                if len(ranked) >= cfg.top_k and lb > ranked[-1][1] * (1 + 1e-12):
                    order += 1
                    continue
                # ILP-B depends only on the multiset of (z_i, S_i): solve each once
                perm = sorted(range(len(zs)), key=lambda i: (zs[i], svec[i], i))
                bkey = tuple((zs[i], svec[i]) for i in perm)
                if bkey not in b_cache:
                    b_cache[bkey] = ilp_b([k[0] for k in bkey], [k[1] for k in bkey], cfg.num_microbatches, cfg.solver_b)
                rb = b_cache[bkey]
                if rb is not None:
                    m = [0] * len(zs)
                    for pos, i in enumerate(perm):
                        m[i] = rb[1][pos]
                    rb = (rb[0], tuple(m))
                if rb is not None:
                    touched = sum(1 for t in tmpl if t)
                    bubble = max((m + S - 1) * z for m, S, z in zip(rb[1], svec, zs))
                    key = (round(rb[0], 9), touched, round(bubble, 9), order)
                    ranked.append((key, rb[0], svec, tmpl, (layers_all, rb[1])))
                    ranked.sort(key=lambda r: r[0])
                    del ranked[cfg.top_k:]
            order += 1
    if not ranked:
        raise ConfigError(_infeasible_message(cfg, groups))
    old_layers = (old_plan or cfg.uniform()).gpu_layers()
    cands = [Candidate(Z, _materialise(cfg, groups, suspended, specials, healthy, svec, tmpl, lm[0], lm[1], old_layers))
             for _, Z, svec, tmpl, lm in ranked]
    if cost_fn is not None:
        cands = [Candidate(c.z, c.plan, float(cost_fn(c.plan))) for c in cands]
        best = min(range(len(cands)), key=lambda i: (round(cands[i].cost_s, 12), i))
    else:
        best = 0
    chosen = cands[best].plan.with_label("malleus")
    y = [_rate([x[g] for g in grp.gpus], chosen.shrink_k(i), cfg) for i, grp in enumerate(chosen.groups)]
    validate_plan(chosen, memory=cfg.memory)
    return PlanResult(chosen, plan_z(chosen, y), y, cands,
                      {"templates": n_templates, "stage_vectors": len(svecs), "ilp_a_solves": len(a_cache), "ilp_b_solves": len(b_cache),
                       "groups": len(groups), "suspended": len(suspended), "chosen_rank": best})


def _infeasible_message(cfg: PlannerConfig, groups) -> str:
    if cfg.memory is None:
        return f"planner: no feasible plan for {len(groups)} groups"
    m = cfg.memory
    need = m.stage_mb(cfg.pp, 0, math.ceil(cfg.num_layers / cfg.pp), 1.0)
    return (f"workload.memory: no layout fits device memory: even the uniform stage 0 needs {need:.0f} MB "
            f"({math.ceil(cfg.num_layers / cfg.pp)} layers x {m.k_mb(cfg.pp):.0f} MB + embedding {m.embed_mb:.0f} MB "
            f"+ extra {m.extra_mb:.0f} MB) > capacity {m.capacity_mb:.0f} MB")


def _materialise(cfg, groups, suspended, specials, healthy, svec, tmpl, layers_all, ms, old_layers) -> Plan:
    """Steps 5-6: put real groups on placeholders, drop empty stages, build the Plan."""
    D = len(svec)
    slots: list[list[Optional[_G]]] = []
    for i in range(D):
        row: list[Optional[_G]] = [specials[s] for s in tmpl[i]] + [None] * (svec[i] - len(tmpl[i]))
        slots.append(row)
    ranges = []
    for i in range(D):
        lo, rr = 0, []
        for n in layers_all[i]:
            rr.append((lo, lo + n))
            lo += n
        ranges.append(rr)
    free = list(healthy)

    def old_range(g: _G) -> tuple[int, int]:
        r = old_layers.get(g.gpus[0])
        return tuple(r) if r is not None else (0, 0)

    def take(i: int, j: int, pool: list[_G]) -> bool:
        if not pool:
            return False
        best = max(pool, key=lambda g: (_iou(old_range(g), ranges[i][j]), -g.gpus[0]))
        pool.remove(best)
        free.remove(best)
        slots[i][j] = best
        return True

    # pass 1: stage columns of pipeline 0's straggler stages, from the straggler's node
    for j in range(len(tmpl[0]) if D else 0):
        node = slots[0][j].node
        for i in range(1, D):
            if j < svec[i] and slots[i][j] is None:
                take(i, j, [g for g in free if g.node == node])
    # pass 2: everything else by global IoU
    for i in range(D):
        for j in range(svec[i]):
            if slots[i][j] is None:
                take(i, j, list(free))
    assert not free, "placeholders and healthy groups must match"
    out_groups: list[Group] = []
    pipes = []
    susp = list(suspended)
    for i in range(D):
        gids, ls = [], []
        for j in range(svec[i]):
            g = slots[i][j]
            if layers_all[i][j] == 0:
                susp += list(g.gpus)
                continue
            gids.append(len(out_groups))
            out_groups.append(Group(g.gpus, g.node))
            ls.append(layers_all[i][j])
        pipes.append(PipelinePlan(tuple(gids), tuple(ls), ms[i]))
    return Plan(cfg.num_gpus, cfg.gpus_per_node, cfg.tp, cfg.num_layers, cfg.num_microbatches, tuple(out_groups),
                tuple(pipes), tuple(sorted(susp)), "malleus")
