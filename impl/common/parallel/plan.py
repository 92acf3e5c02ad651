"""Hybrid-parallel plans as plain data (the variables and output of Malleus's planner, the
authors' code Hetu `python/hetu/engine/strategy.py`).

A :class:`Plan` says, for one training job on ``num_gpus`` GPUs in nodes of ``gpus_per_node``:
- the tensor-parallel groups (each inside one node, of size ``tp / 2**k``),
- the pipelines: for each, the group that runs each stage, the layers per stage (contiguous,
  in order) and the micro-batches the pipeline takes from the global batch,
- the suspended GPUs (in no group: they hold no state and join no collective).

Plans print (:func:`format_plan`), diff (:func:`plan_diff`), round-trip through dicts/JSON and
are checked by :func:`validate_plan` (every violated plan invariant, listed). Straggling
rates are not part of a plan: a group's rate ``y = alpha_k * max x`` is computed from the
rates at hand (:func:`group_rates`), so the same plan can be scored under any rates.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from impl.common.api import ConfigError

# A group rate under this counts as healthy (Malleus's hysteresis, the authors' code, PKU-DAIR/Hetu).
HEALTHY_BELOW = 1.2


class PlanError(ConfigError):
    """A plan breaks an invariant; the message lists every violation found."""


@dataclass(frozen=True)
class Group:
    """One tensor-parallel group: GPU ids inside one node."""

    gpus: tuple[int, ...]
    node: int

    @property
    def size(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True)
class PipelinePlan:
    """One pipeline: ``groups[j]`` (an index into ``Plan.groups``) runs stage j with
    ``layers[j]`` consecutive layers; the pipeline takes ``micro_batches`` of the global batch."""

    groups: tuple[int, ...]
    layers: tuple[int, ...]
    micro_batches: int

    @property
    def num_stages(self) -> int:
        return len(self.groups)

    def layer_ranges(self) -> list[tuple[int, int]]:
        out, lo = [], 0
        for n in self.layers:
            out.append((lo, lo + n))
            lo += n
        return out


@dataclass(frozen=True)
class Plan:
    num_gpus: int
    gpus_per_node: int
    tp: int  # nominal TP degree; groups are tp / 2**k
    num_layers: int
    num_microbatches: int
    groups: tuple[Group, ...]
    pipelines: tuple[PipelinePlan, ...]
    suspended: tuple[int, ...] = ()
    label: str = ""

    # ---- derived views ------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return len(self.pipelines)

    @property
    def active_gpus(self) -> tuple[int, ...]:
        return tuple(sorted(g for grp in self.groups for g in grp.gpus))

    def shrink_k(self, group: int) -> int:
        """k such that the group has tp / 2**k GPUs."""
        return int(round(math.log2(self.tp / self.groups[group].size)))

    def rank_map(self) -> list[dict]:
        """Rank -> device: ranks enumerate pipelines, then stages, then TP ranks."""
        out = []
        for i, p in enumerate(self.pipelines):
            for j, (g, (lo, hi)) in enumerate(zip(p.groups, p.layer_ranges())):
                for t, dev in enumerate(self.groups[g].gpus):
                    out.append({"rank": len(out), "device": dev, "node": self.groups[g].node, "pipeline": i,
                                "stage": j, "tp_rank": t, "tp_size": self.groups[g].size, "layers": [lo, hi]})
        return out

    def gpu_layout(self) -> dict[int, dict]:
        """device -> its rank_map entry (active GPUs only)."""
        return {e["device"]: e for e in self.rank_map()}

    def gpu_layers(self) -> dict[int, tuple[int, int]]:
        return {d: tuple(e["layers"]) for d, e in self.gpu_layout().items()}

    # ---- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "num_gpus": self.num_gpus, "gpus_per_node": self.gpus_per_node, "tp": self.tp,
            "num_layers": self.num_layers, "num_microbatches": self.num_microbatches, "label": self.label,
            "groups": [list(g.gpus) for g in self.groups],
            "pipelines": [{"groups": list(p.groups), "layers": list(p.layers), "micro_batches": p.micro_batches}
                          for p in self.pipelines],
            "suspended": list(self.suspended),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        gpn = int(d["gpus_per_node"])
        groups = tuple(Group(tuple(int(x) for x in g), int(g[0]) // gpn) for g in d["groups"])
        pipes = tuple(PipelinePlan(tuple(p["groups"]), tuple(p["layers"]), int(p["micro_batches"]))
                      for p in d["pipelines"])
        return cls(int(d["num_gpus"]), gpn, int(d["tp"]), int(d["num_layers"]), int(d["num_microbatches"]),
                   groups, pipes, tuple(d.get("suspended", ())), d.get("label", ""))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def signature(self) -> tuple:
        """What matters for execution (label excluded): equal signatures = same plan."""
        return (tuple(g.gpus for g in self.groups),
                tuple((tuple(self.groups[g].gpus for g in p.groups), p.layers, p.micro_batches) for p in self.pipelines),
                self.suspended)

    def with_label(self, label: str) -> "Plan":
        return Plan(self.num_gpus, self.gpus_per_node, self.tp, self.num_layers, self.num_microbatches,
                    self.groups, self.pipelines, self.suspended, label)


# ---------------------------------------------------------------------------------------
# rates and the ILP objective
# ---------------------------------------------------------------------------------------


def effective_rate(y: float, healthy_below: float = HEALTHY_BELOW) -> float:
    """Malleus's hysteresis: a rate under 1.2 counts as 1 (also faster-than-nominal GPUs)."""
    return 1.0 if y < healthy_below else float(y)


def group_rate(plan: Plan, group: int, x: Sequence[float], alpha: Sequence[float],
               healthy_below: float = HEALTHY_BELOW) -> float:
    """y = alpha_k * max_{g in group} x_g, then the hysteresis."""
    k = plan.shrink_k(group)
    if k >= len(alpha):
        raise PlanError(f"group {plan.groups[group].gpus} has tp/{2 ** k} GPUs but alpha has only {len(alpha)} entries")
    return effective_rate(alpha[k] * max(x[g] for g in plan.groups[group].gpus), healthy_below)


def group_rates(plan: Plan, x: Sequence[float], alpha: Sequence[float],
                healthy_below: float = HEALTHY_BELOW) -> list[float]:
    return [group_rate(plan, g, x, alpha, healthy_below) for g in range(len(plan.groups))]


def pipeline_z(plan: Plan, y: Sequence[float]) -> list[float]:
    """z_i = max_j y_ij * l_ij (healthy per-layer per-micro-batch time units)."""
    return [max(y[g] * n for g, n in zip(p.groups, p.layers)) for p in plan.pipelines]


def plan_z(plan: Plan, y: Sequence[float]) -> float:
    """The planner's objective Z = max_i m_i * z_i (bubbles and communication ignored)."""
    return max(p.micro_batches * z for p, z in zip(plan.pipelines, pipeline_z(plan, y)))


def z_lower_bound(plan: Plan, y: Sequence[float]) -> float:
    """L * M / sum over groups of 1/y: Z can do no better than perfectly balanced work."""
    return plan.num_layers * plan.num_microbatches / math.fsum(1.0 / v for v in y)


# ---------------------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------------------


def even_split(total: int, parts: int) -> tuple[int, ...]:
    """As even as possible, the first ``total % parts`` parts one larger."""
    q, r = divmod(total, parts)
    return tuple(q + 1 if i < r else q for i in range(parts))


def uniform_plan(num_gpus: int, gpus_per_node: int, dp: int, tp: int, pp: int, num_layers: int,
                 num_microbatches: int, label: str = "uniform", cross_node_tp: bool = False) -> Plan:
    """Megatron's layout (tp fastest, then dp, then pp): stage p of pipeline d on GPUs
    ``p*dp*tp + d*tp + [0, tp)``; layers and micro-batches split evenly. ``cross_node_tp``
    lets a TP group span whole nodes (HotSPa's 32B presets use tp 16 on 8-GPU nodes); such a
    plan is for placement and migration planning only (:func:`plan_violations` rejects it)."""
    if dp * tp * pp != num_gpus:
        raise ConfigError(f"workload: dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} does not match num_gpus {num_gpus}")
    if cross_node_tp and tp > gpus_per_node:
        if tp % gpus_per_node:
            raise ConfigError(f"workload.tp: {tp} spans nodes, so it must be a multiple of gpus_per_node {gpus_per_node}")
    elif tp > gpus_per_node or gpus_per_node % tp:
        raise ConfigError(f"workload.tp: {tp} must divide gpus_per_node {gpus_per_node}")
    if num_layers < pp:
        raise ConfigError(f"workload: pipeline of {pp} stages cannot split {num_layers} layers (need >= 1 per stage)")
    if num_microbatches < dp * pp:
        raise ConfigError(f"workload: {num_microbatches} micro-batches cannot feed {dp} pipelines of {pp} stages "
                          f"(need m_i >= stages, i.e. >= {dp * pp})")
    groups, index = [], {}
    for p in range(pp):
        for d in range(dp):
            base = p * dp * tp + d * tp
            index[(d, p)] = len(groups)
            groups.append(Group(tuple(range(base, base + tp)), base // gpus_per_node))
    layers = even_split(num_layers, pp)
    ms = even_split(num_microbatches, dp)
    pipes = tuple(PipelinePlan(tuple(index[(d, p)] for p in range(pp)), layers, ms[d]) for d in range(dp))
    return Plan(num_gpus, gpus_per_node, tp, num_layers, num_microbatches, tuple(groups), pipes, (), label)


# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------


def plan_violations(plan: Plan, *, memory=None, x: Optional[Sequence[float]] = None,
                    alpha: Optional[Sequence[float]] = None, z: Optional[float] = None,
                    rel_tol: float = 1e-9) -> list[str]:
    """Every broken invariant, one line each (empty = valid).

    ``memory``: an object with ``fits(stages, stage, layers, ratio)`` (see
    :class:`impl.common.parallel.cost.StageMemoryRows`). ``x``/``alpha``: per-GPU rates and the
    TP-shrink slowdowns, to recheck ``z`` (the solver's Z) and the lower bound.
    """
    v: list[str] = []
    seen: dict[int, str] = {}
    for gi, grp in enumerate(plan.groups):
        if not grp.gpus:
            v.append(f"group {gi} is empty")
            continue
        size = grp.size
        if size > plan.tp or plan.tp % size or (size & (size - 1)):
            v.append(f"group {gi} {list(grp.gpus)} has {size} GPUs; sizes must be tp/2^k for tp={plan.tp}")
        nodes = {g // plan.gpus_per_node for g in grp.gpus}
        if len(nodes) != 1 or grp.node not in nodes:
            v.append(f"group {gi} {list(grp.gpus)} spans nodes {sorted(nodes)} (declared node {grp.node}); TP groups are intra-node")
        for g in grp.gpus:
            if not 0 <= g < plan.num_gpus:
                v.append(f"group {gi} holds GPU {g}, which does not exist ({plan.num_gpus} GPUs)")
            if g in seen:
                v.append(f"GPU {g} is in {seen[g]} and group {gi}")
            seen[g] = f"group {gi}"
    for g in plan.suspended:
        if g in seen:
            v.append(f"GPU {g} is suspended but also in {seen[g]}")
        seen[g] = "suspended"
    missing = sorted(set(range(plan.num_gpus)) - set(seen))
    if missing:
        v.append(f"GPUs {missing} are neither active nor suspended")
    used: dict[int, tuple[int, int]] = {}
    for i, p in enumerate(plan.pipelines):
        if len(p.groups) != len(p.layers) or not p.groups:
            v.append(f"pipeline {i}: {len(p.groups)} stages but {len(p.layers)} layer counts")
            continue
        for j, g in enumerate(p.groups):
            if not 0 <= g < len(plan.groups):
                v.append(f"pipeline {i} stage {j}: group {g} does not exist")
            elif g in used:
                v.append(f"group {g} runs pipeline {used[g][0]} stage {used[g][1]} and pipeline {i} stage {j}")
            used[g] = (i, j)
        bad = [n for n in p.layers if n < 1]
        if bad:
            v.append(f"pipeline {i}: stages with {bad[0]} layers (a group with no layers must be suspended)")
        if sum(p.layers) != plan.num_layers:
            v.append(f"pipeline {i}: layers {list(p.layers)} sum to {sum(p.layers)}, not L={plan.num_layers}")
        if p.micro_batches < p.num_stages:
            v.append(f"pipeline {i}: m={p.micro_batches} < {p.num_stages} stages")
        if memory is not None:
            for j, (g, n) in enumerate(zip(p.groups, p.layers)):
                if 0 <= g < len(plan.groups):
                    ratio = plan.tp / plan.groups[g].size
                    if not memory.fits(p.num_stages, j, n, ratio):
                        v.append(f"pipeline {i} stage {j}: {n} layers on {plan.groups[g].size} GPU(s) need "
                                 f"{memory.stage_mb(p.num_stages, j, n, ratio):.0f} MB > capacity {memory.capacity_mb:.0f} MB")
    unused = sorted(set(range(len(plan.groups))) - set(used))
    if unused:
        v.append(f"groups {unused} run no stage (suspend their GPUs instead)")
    total_m = sum(p.micro_batches for p in plan.pipelines)
    if total_m != plan.num_microbatches:
        v.append(f"micro-batches {[p.micro_batches for p in plan.pipelines]} sum to {total_m}, not M={plan.num_microbatches}")
    if x is not None and alpha is not None and not v:
        y = group_rates(plan, x, alpha)
        zz = plan_z(plan, y)
        if z is not None and not math.isclose(zz, z, rel_tol=rel_tol, abs_tol=1e-9):
            v.append(f"recomputed Z {zz:.6g} differs from the solver's {z:.6g}")
        lb = z_lower_bound(plan, y)
        if zz < lb * (1 - 1e-9):
            v.append(f"Z {zz:.6g} is below the lower bound L*M/sum(1/y) = {lb:.6g}")
    return v


def validate_plan(plan: Plan, **kw) -> Plan:
    """Raise :class:`PlanError` listing every violation; return the plan when valid."""
    v = plan_violations(plan, **kw)
    if v:
        raise PlanError(f"invalid plan{(' ' + plan.label) if plan.label else ''}: " + "; ".join(v))
    return plan


# ---------------------------------------------------------------------------------------
# printing and diffing
# ---------------------------------------------------------------------------------------


def format_plan(plan: Plan, y: Optional[Sequence[float]] = None) -> str:
    """One line per pipeline: ``P0 m=11 | [0-1]x2 L0-10 (y=2.34) | ...``."""
    lines = [f"plan {plan.label or '-'}: {plan.num_gpus} GPUs, L={plan.num_layers}, M={plan.num_microbatches}, "
             f"{len(plan.groups)} groups, suspended {list(plan.suspended)}"]
    for i, p in enumerate(plan.pipelines):
        cells = []
        for g, (lo, hi) in zip(p.groups, p.layer_ranges()):
            gpus = plan.groups[g].gpus
            dev = f"{gpus[0]}" if len(gpus) == 1 else f"{gpus[0]}-{gpus[-1]}" if gpus == tuple(range(gpus[0], gpus[-1] + 1)) else ",".join(map(str, gpus))
            rate = f" y={y[g]:.3g}" if y is not None else ""
            cells.append(f"[{dev}] L{lo}-{hi - 1} ({hi - lo}){rate}")
        lines.append(f"  P{i} m={p.micro_batches:<3d} | " + " | ".join(cells))
    if y is not None:
        lines.append(f"  Z = {plan_z(plan, y):.6g}")
    return "\n".join(lines)


def plan_diff(old: Plan, new: Plan) -> list[str]:
    """Human-readable per-GPU changes (layers held, TP group size, suspension)."""
    a, b = old.gpu_layout(), new.gpu_layout()
    out = []
    for g in range(max(old.num_gpus, new.num_gpus)):
        ea, eb = a.get(g), b.get(g)
        if ea is None and eb is None:
            continue
        if ea is None:
            out.append(f"GPU {g}: resumed -> P{eb['pipeline']}S{eb['stage']} layers {eb['layers']} tp{eb['tp_size']}")
        elif eb is None:
            out.append(f"GPU {g}: P{ea['pipeline']}S{ea['stage']} -> suspended")
        elif (ea["layers"], ea["tp_size"], ea["tp_rank"], ea["pipeline"], ea["stage"]) != (eb["layers"], eb["tp_size"], eb["tp_rank"], eb["pipeline"], eb["stage"]):
            out.append(f"GPU {g}: P{ea['pipeline']}S{ea['stage']} layers {ea['layers']} tp{ea['tp_size']} -> "
                       f"P{eb['pipeline']}S{eb['stage']} layers {eb['layers']} tp{eb['tp_size']}")
    ma = [p.micro_batches for p in old.pipelines]
    mb = [p.micro_batches for p in new.pipelines]
    if ma != mb:
        out.append(f"micro-batches {ma} -> {mb}")
    return out
