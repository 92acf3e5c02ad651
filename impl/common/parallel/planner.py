"""A heterogeneous DP x TP x PP planner over per-GPU rates (Malleus's six-step planner,
the authors' code Hetu `python/hetu/engine/strategy.py`; reused by checkpoint recovery, as
Elastor's reference code reuses it). Inputs are plain data: rates x_g (1 = healthy,
2 = twice as slow), the TP slowdown per shrink level (alpha), node size, layer and
micro-batch counts, an optional memory model and GPUs that are not available at all.

1. TP groups per node (:func:`impl.common.parallel.tp_groups.node_groups`).
2. Stage-count vectors (:func:`stage_vectors`).
3. Templates (:func:`templates`): DFS puts the non-placeholder groups (y descending) on the
   leading stages of pipelines; pipelines of equal depth are interchangeable, so a group only
   goes to the first of several identical-so-far pipelines, and templates are ordered
   canonically (more slow groups first; on a tie the larger first rate first).
4. ILP-A per pipeline and ILP-B per template (:mod:`impl.common.parallel.ilp`); infeasible
   templates are dropped; the top k by Z are kept, ties by enumeration order.
5. Placeholders get real healthy groups: pass 1 fills the stage columns of pipeline 0's
   slow stages from the slow group's node; pass 2 the rest by the best IoU of the group's
   old layer range (so migration can reuse state in place).
6. A :class:`~impl.common.parallel.plan.Plan`; groups with no layers are suspended, and so
   are unavailable GPUs.

The top-k plans are then re-scored with the full cost model (fill bubbles and communication,
which Z ignores) when a ``cost_fn`` is given; the result keeps every candidate for reports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from impl.common.api import ConfigError

from .ilp import ilp_a, ilp_a_value, ilp_b
from .plan import HEALTHY_BELOW, Group, Plan, PipelinePlan, plan_z, uniform_plan, validate_plan
from .tp_groups import TPGroup, check_levels, check_shrink_penalty, node_groups, tp_group_rate


class PlannerError(ConfigError):
    """No plan satisfies the planner's constraints; the message names the one that failed."""


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
    memory: object = None  # impl.common.parallel.cost.StageMemoryRows or None
    top_k: int = 5
    # w_k of step 1's score per shrink level k (index 0 = a full group = 1.0).
    shrink_penalty: tuple[float, ...] = (1.0, 2.0, 2.0, 2.0)
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
        check_levels("workload.alpha", self.alpha, self.tp)
        check_shrink_penalty("shrink_penalty", self.shrink_penalty, self.tp)

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


def _rate(xs: Sequence[float], k: int, cfg: PlannerConfig) -> float:
    return tp_group_rate(xs, k, cfg.alpha, cfg.healthy_below)


def all_groups(x: Sequence[float], cfg: PlannerConfig, unavailable: Sequence[int] = ()) -> tuple[list[TPGroup], list[int]]:
    """Step 1 on every node; ``unavailable`` GPUs join no group (and are not listed)."""
    out = set(unavailable)
    gpn = cfg.gpus_per_node
    groups, suspended = [], []
    for n in range(cfg.num_nodes):
        ids = [g for g in range(n * gpn, (n + 1) * gpn) if g not in out]
        g, s = node_groups(ids, n, x, cfg.tp, cfg.alpha, cfg.shrink_penalty, cfg.healthy_below)
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


def templates(specials: Sequence[TPGroup], svec: Sequence[int], limit: int) -> list[list[list[int]]]:
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


def check_feasible(cfg: PlannerConfig, x: Sequence[float], unavailable: Sequence[int] = ()) -> None:
    """Steps 1-2 only (no ILP): a cheap preflight that raises the :class:`PlannerError` a
    plan for rates ``x`` would meet in forming groups and pipelines."""
    groups, _ = all_groups(x, cfg, unavailable)
    if not stage_vectors(len(groups), cfg):
        raise PlannerError(_no_stage_vector_message(cfg, groups))


def _iou(a: tuple[int, int], b: tuple[int, int]) -> float:
    inter = max(0, min(a[1], b[1]) - max(a[0], b[0]))
    union = max(a[1], b[1]) - min(a[0], b[0])
    return inter / union if union > 0 else 0.0


def plan(cfg: PlannerConfig, x: Sequence[float], old_plan: Optional[Plan] = None,
         cost_fn: Optional[Callable[[Plan], float]] = None, unavailable: Sequence[int] = (),
         label: str = "planned") -> PlanResult:
    """The best plan for per-GPU rates ``x`` (len = num_gpus); ``unavailable`` GPUs (lost,
    say) join no group and are listed as suspended. Raises :class:`PlannerError` naming the
    constraint that no plan satisfies."""
    if len(x) != cfg.num_gpus:
        raise ConfigError(f"straggling rates: got {len(x)} for {cfg.num_gpus} GPUs")
    for g, v in enumerate(x):
        if not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"straggling rate of GPU {g} must be a positive finite number, got {v}")
    groups, suspended = all_groups(x, cfg, unavailable)
    suspended = sorted(set(suspended) | set(unavailable))
    specials = sorted([g for g in groups if not (g.k == 0 and g.y == 1.0)], key=lambda g: (-g.y, g.k, g.gpus))
    healthy = [g for g in groups if g.k == 0 and g.y == 1.0]
    svecs = stage_vectors(len(groups), cfg)
    if not svecs:
        raise PlannerError(_no_stage_vector_message(cfg, groups))
    best_cap: Optional[tuple[int, int]] = None  # (layers the roomiest infeasible pipeline holds, its stages)
    # Templates are ranked by ILP-A's optimal z, whose value is unique and found without a
    # solver (ilp_a_value); the solver is asked only for the layers of the top k kept at the
    # end. The S1-S7 presets spent most of their planning time in CBC runs whose layers were
    # never used (tests/bench: same plans, same candidates).
    z_cache: dict = {}
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
            zs, specs = [], []
            for i, S in enumerate(svec):
                spec = tuple((specials[s].y, cfg.tp / len(specials[s].gpus)) for s in tmpl[i])
                spec += ((1.0, 1.0),) * (S - len(tmpl[i]))
                if spec not in z_cache:
                    z_cache[spec] = ilp_a_value([s[0] for s in spec], [s[1] for s in spec], cfg.num_layers,
                                                cfg.memory)
                z = z_cache[spec]
                if z is None:
                    cap = _layer_capacity(cfg, spec)
                    if best_cap is None or cap > best_cap[0]:
                        best_cap = (cap, S)
                    break
                zs.append(z)
                specs.append(spec)
            else:
                # continuous lower bound of ILP-B: skip templates that cannot enter the top k
                lb = cfg.num_microbatches / math.fsum(1.0 / z for z in zs)
                if len(ranked) >= cfg.top_k and lb > ranked[-1][1] * (1 + 1e-12):
                    order += 1
                    continue
                rb = _solve_b(zs, svec, cfg, b_cache)
                if rb is not None:
                    touched = sum(1 for t in tmpl if t)
                    bubble = max((m + S - 1) * z for m, S, z in zip(rb[1], svec, zs))
                    key = (round(rb[0], 9), touched, round(bubble, 9), order)
                    ranked.append((key, rb[0], svec, tmpl, (specs, rb[1])))
                    ranked.sort(key=lambda r: r[0])
                    del ranked[cfg.top_k:]
            order += 1
    if not ranked:
        raise PlannerError(_infeasible_message(cfg, groups, best_cap))
    # The kept templates' layers from the solver. A solver's optimum may sit an ulp off the
    # exact one (CBC's tolerance: 2.0000000000000004 x 9 layers for 18.0); its z is the one the
    # layers give, so ILP-B and the tie-break key are recomputed from it.
    for r in range(len(ranked)):
        key, Z, svec, tmpl, (specs, m) = ranked[r]
        layers_all, zs = [], []
        for spec in specs:
            if spec not in a_cache:
                a_cache[spec] = ilp_a([s[0] for s in spec], [s[1] for s in spec], cfg.num_layers,
                                      cfg.memory, cfg.solver_a)
            res = a_cache[spec]
            if res is None:
                raise PlannerError(f"planner: ILP-A ({cfg.solver_a}) found no layers for stages {spec}, "
                                   f"whose optimum is z = {z_cache[spec]!r}")
            zs.append(res[0])
            layers_all.append(res[1])
        if zs != [z_cache[spec] for spec in specs]:
            rb = _solve_b(zs, svec, cfg, b_cache)
            if rb is None:
                raise PlannerError(f"planner: ILP-B found no micro-batches for pipelines of z = {zs}")
            Z, m = rb
            key = (round(Z, 9), key[1], round(max((mi + S - 1) * z for mi, S, z in zip(m, svec, zs)), 9), key[3])
        ranked[r] = (key, Z, svec, tmpl, (layers_all, m))
    ranked.sort(key=lambda r: r[0])
    old_layers = (old_plan or cfg.uniform()).gpu_layers()
    cands = [Candidate(Z, _materialise(cfg, groups, suspended, specials, healthy, svec, tmpl, lm[0], lm[1], old_layers,
                                       label))
             for _, Z, svec, tmpl, lm in ranked]
    if cost_fn is not None:
        cands = [Candidate(c.z, c.plan, float(cost_fn(c.plan))) for c in cands]
        best = min(range(len(cands)), key=lambda i: (round(cands[i].cost_s, 12), i))
    else:
        best = 0
    chosen = cands[best].plan
    y = [_rate([x[g] for g in grp.gpus], chosen.shrink_k(i), cfg) for i, grp in enumerate(chosen.groups)]
    validate_plan(chosen, memory=cfg.memory)
    return PlanResult(chosen, plan_z(chosen, y), y, cands,
                      {"templates": n_templates, "stage_vectors": len(svecs), "ilp_a_values": len(z_cache), "ilp_a_solves": len(a_cache), "ilp_b_solves": len(b_cache),
                       "groups": len(groups), "suspended": len(suspended), "chosen_rank": best})


def _node_sizes(groups: Sequence[TPGroup]) -> str:
    by_node: dict = {}
    for g in groups:
        by_node.setdefault(g.node, []).append(len(g.gpus))
    return ", ".join(f"node {n}: {'+'.join(map(str, v))}" for n, v in sorted(by_node.items()))


def _no_stage_vector_message(cfg: PlannerConfig, groups: Sequence[TPGroup]) -> str:
    G, D, M, L = len(groups), cfg.dp, cfg.num_microbatches, cfg.num_layers
    shrunk = [g for g in groups if g.k > 0]
    where = f" (shrunk groups: {_node_sizes([g for g in groups if g.node in {s.node for s in shrunk}])})" if shrunk else ""
    if G < D:
        why = f"{G} TP groups cannot fill dp={D} pipelines (one group per pipeline at least)"
    elif G > M:
        why = f"{G} TP groups need >= {G} micro-batches (m_i >= stages of pipeline i), num_microbatches is {M}"
    elif -(-G // D) > L:
        why = f"{G} TP groups in dp={D} pipelines need >= {-(-G // D)} stages in a pipeline, more than its {L} layers"
    else:
        why = f"{G} TP groups have no stage split over dp={D} pipelines within {M} micro-batches and {L} layers"
    return f"planner: {why}{where}"


def _solve_b(zs: Sequence[float], svec: Sequence[int], cfg: PlannerConfig, b_cache: dict):
    """ILP-B for pipelines of bottlenecks ``zs`` and depths ``svec``: (Z, m in pipeline order).
    It depends only on the multiset of (z_i, S_i): each is solved once."""
    perm = sorted(range(len(zs)), key=lambda i: (zs[i], svec[i], i))
    bkey = tuple((zs[i], svec[i]) for i in perm)
    if bkey not in b_cache:
        b_cache[bkey] = ilp_b([k[0] for k in bkey], [k[1] for k in bkey], cfg.num_microbatches, cfg.solver_b)
    rb = b_cache[bkey]
    if rb is None:
        return None
    m = [0] * len(zs)
    for pos, i in enumerate(perm):
        m[i] = rb[1][pos]
    return rb[0], tuple(m)


def _layer_capacity(cfg: PlannerConfig, spec) -> int:
    """Layers a pipeline of these (rate, memory ratio) stages can hold under the memory model."""
    S = len(spec)
    return sum(min(cfg.num_layers, cfg.memory.max_layers(S, j, r)) for j, (_, r) in enumerate(spec))


def _infeasible_message(cfg: PlannerConfig, groups, best_cap: Optional[tuple[int, int]]) -> str:
    if cfg.memory is None or best_cap is None:
        return f"planner: no template of {len(groups)} TP groups has a feasible ILP-A / ILP-B solution"
    m = cfg.memory
    stage0 = math.ceil(cfg.num_layers / cfg.pp)
    need = m.stage_mb(cfg.pp, 0, stage0, 1.0)
    if need > m.capacity_mb:
        return (f"workload.memory: no layout fits device memory: even the uniform stage 0 needs {need:.0f} MB "
                f"({stage0} layers x {m.k_mb(cfg.pp):.0f} MB + embedding {m.embed_mb:.0f} MB "
                f"+ extra {m.extra_mb:.0f} MB) > capacity {m.capacity_mb:.0f} MB")
    cap, S = best_cap
    return (f"workload.memory: no layout fits device memory: with {len(groups)} TP groups ({_node_sizes(groups)}) "
            f"the roomiest pipeline tried ({S} stages) holds at most {cap} of {cfg.num_layers} layers "
            f"at capacity {m.capacity_mb:.0f} MB per GPU")


def _materialise(cfg, groups, suspended, specials, healthy, svec, tmpl, layers_all, ms, old_layers, label) -> Plan:
    """Steps 5-6: put real groups on placeholders, drop empty stages, build the Plan."""
    D = len(svec)
    slots: list[list[Optional[TPGroup]]] = []
    for i in range(D):
        row: list[Optional[TPGroup]] = [specials[s] for s in tmpl[i]] + [None] * (svec[i] - len(tmpl[i]))
        slots.append(row)
    ranges = []
    for i in range(D):
        lo, rr = 0, []
        for n in layers_all[i]:
            rr.append((lo, lo + n))
            lo += n
        ranges.append(rr)
    free = list(healthy)

    def old_range(g: TPGroup) -> tuple[int, int]:
        r = old_layers.get(g.gpus[0])
        return tuple(r) if r is not None else (0, 0)

    def take(i: int, j: int, pool: list[TPGroup]) -> bool:
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
                tuple(pipes), tuple(sorted(susp)), label)
