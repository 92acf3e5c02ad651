"""Hot switching of parameters and gradients between layouts (the schedule and switch
planner of the authors' code, `examples/hotspa` and `hetu/graph/switch_exec_graph.*`, on the real
CPU experiment's layouts).

A *layout* says which fraction of every tensor each rank holds:
- ``home``: the state layout. Rank r of W holds fraction ``[r/W, (r+1)/W)`` of every tensor
  (the fp32 master weights, their Adam state and the gradient accumulator): the split weights
  as their TP shard, the whole ones ZeRO-style.
- a compute layout per strategy (dp, tp, 1): split weights as TP shard ``r % tp`` inside
  DP replica ``r // tp``, the embedding, norms and head whole on every rank.
Each layout maps a tensor to a Malleus :class:`~impl.common.parallel.plan.Plan` (home: one TP
group of W; compute: ``uniform_plan(dp, tp)`` for split weights and ``uniform_plan(W, 1)``
for whole ones), so :func:`impl.common.parallel.migration.plan_migration` (the bandwidth-aware
greedy of the authors' switch planner; units = embeddings, layers, head) plans every switch: the slice cover, local
rebinding of what the needer already holds, and the sender of every other slice.

A :class:`Switch` is that plan as data for every rank: local pieces and, per peer pair, the
ordered pieces of one send and one receive buffer. :meth:`Switch.run` packs the buffers and
issues **one** ``dist.batch_isend_irecv`` group (copy, or add into the destination). Switches
are built once per (from, to) and cached (:class:`SwitchCache`); later steps only transfer.

Gradients leave a strategy reduced over its DP group (as in the authors' code): with DP replicas (tp = 1) the
partial sums are reduce-scattered onto the home owners by the *transpose* of the home->DP
all-gather switch (each piece travels the other way and is added), so every partial is sent
once and no summed value moves twice; with TP (dp = 1) the gradients are already complete
(split weights per shard, whole weights identical on every TP rank) and each rank adds its own
fraction locally (:func:`grad_switch`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from impl.common.api import ConfigError
from impl.common.parallel.migration import held_units, plan_migration
from impl.common.parallel.plan import Plan, uniform_plan
from impl.common.parallel.tensor_parallel import compute_dim, fraction_slice, shard_dim
from impl.common.runtime.migrate import unit_param_names

from impl.hotspa.strategy import Strategy

HOME = "home"


def layout_name(s: Strategy) -> str:
    return f"dp{s.dp}tp{s.tp}"


@dataclass(frozen=True)
class Layouts:
    """Layouts of one job: ``num_gpus`` ranks, one per GPU, ``gpus_per_node`` per node."""

    num_gpus: int
    gpus_per_node: int
    num_layers: int

    def _plan(self, dp: int, tp: int) -> Plan:
        return uniform_plan(self.num_gpus, self.gpus_per_node, dp, tp, 1, self.num_layers, max(dp, 1),
                            label=f"dp{dp}tp{tp}")

    def plan_of(self, layout: str, name: str) -> Plan:
        if layout == HOME:
            return self._plan(1, self.num_gpus)
        dp, tp = (int(x) for x in layout[2:].split("tp"))
        return self._plan(dp, tp) if compute_dim(name) is not None else self._plan(self.num_gpus, 1)

    def held(self, layout: str, name: str, unit: int, rank: int) -> tuple[Fraction, Fraction]:
        return held_units(self.plan_of(layout, name))[rank][unit]


@dataclass(frozen=True)
class Piece:
    name: str
    lo: Fraction
    hi: Fraction


@dataclass
class Switch:
    """One planned switch ``src -> dst`` over every rank (plain data: print, check, run)."""

    src: str
    dst: str
    names: tuple[str, ...]
    local: dict[int, list[Piece]] = field(default_factory=dict)  # rank -> pieces it copies itself
    pairs: dict[tuple[int, int], list[Piece]] = field(default_factory=dict)  # (sender, receiver) -> pieces
    summary: dict = field(default_factory=dict)

    def bytes_moved(self, numel: Callable[[Piece], int], elem_bytes: int = 4) -> int:
        return elem_bytes * sum(numel(p) for ps in self.pairs.values() for p in ps)

    def reversed(self) -> "Switch":
        """The transpose: every piece travels receiver -> sender (gradients back to owners)."""
        return Switch(self.dst, self.src, self.names, {r: list(ps) for r, ps in self.local.items()},
                      {(b, a): list(ps) for (a, b), ps in self.pairs.items()}, dict(self.summary))

    def run(self, rank: int, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
            view_src: Callable[[Mapping, Piece], torch.Tensor], view_dst: Callable[[Mapping, Piece], torch.Tensor],
            add: bool = False, group=None) -> int:
        """Execute this rank's part: local pieces, then one batched isend/irecv group. Returns
        the bytes this rank received."""
        for p in self.local.get(rank, []):
            v = view_dst(dst, p)
            v.add_(view_src(src, p)) if add else v.copy_(view_src(src, p))
        ops, recvs = [], []
        # The wire carries the destination layout's dtype (every rank holds the same dtypes per
        # layout): bf16 compute views in, fp32 master/accumulator out; buffers on the rank's device.
        like = next(iter(dst.values()))
        for (a, b), pieces in sorted(self.pairs.items()):
            if a == rank:
                buf = torch.cat([view_src(src, p).reshape(-1) for p in pieces]).to(like.dtype)
                ops.append(dist.P2POp(dist.isend, buf, b, group))
            elif b == rank:
                n = sum(view_dst(dst, p).numel() for p in pieces)
                buf = torch.empty(n, dtype=like.dtype, device=like.device)
                recvs.append((pieces, buf))
                ops.append(dist.P2POp(dist.irecv, buf, a, group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        got = 0
        for pieces, buf in recvs:
            off = 0
            for p in pieces:
                v = view_dst(dst, p)
                chunk = buf[off:off + v.numel()].view_as(v)
                v.add_(chunk) if add else v.copy_(chunk)
                off += v.numel()
            got += buf.numel() * buf.element_size()
        return got


def plan_switch(layouts: Layouts, src: str, dst: str, shapes: Mapping[str, tuple[int, ...]],
                policy: str = "bandwidth_greedy") -> Switch:
    """The switch ``src -> dst`` for tensors of ``shapes`` (full shapes), via plan_migration
    with the system's ``switch_policy``."""
    L = layouts.num_layers
    unit_of = {n: u for u, ns in _units(shapes, L).items() for n in ns}
    by_pair: dict[tuple, list[str]] = {}
    for n in shapes:
        key = (layouts.plan_of(src, n).signature(), layouts.plan_of(dst, n).signature())
        by_pair.setdefault(key, []).append(n)
    sw = Switch(src, dst, tuple(shapes))
    summary = {"transfers": 0, "bytes_moved": 0.0, "bytes_reused": 0.0}
    for names in by_pair.values():
        old, new = layouts.plan_of(src, names[0]), layouts.plan_of(dst, names[0])
        numel = {u: 0 for u in range(-1, L + 1)}
        for n in names:
            numel[unit_of[n]] += _numel(shapes[n])
        transfers, s = plan_migration(old, new, lambda u: 4.0 * numel[u], policy)
        for k in summary:
            summary[k] += s[k]
        for t in transfers:
            for n in names:
                if unit_of[n] == t.unit:
                    sw.pairs.setdefault((t.src, t.dst), []).append(Piece(n, t.lo, t.hi))
        have, need = held_units(old), held_units(new)
        for rank, units in need.items():
            for n in names:
                lo, hi = units[unit_of[n]]
                a, b = have.get(rank, {}).get(unit_of[n], (Fraction(0), Fraction(0)))
                lo2, hi2 = max(lo, a), min(hi, b)
                if lo2 < hi2:
                    sw.local.setdefault(rank, []).append(Piece(n, lo2, hi2))
    for ps in sw.pairs.values():
        ps.sort(key=lambda p: (p.name, p.lo))
    sw.summary = summary
    return sw


def check_switch(layouts: Layouts, sw: Switch, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Every (needer, slice) covered exactly once, by a local piece or a sender that owns it."""
    L = layouts.num_layers
    unit_of = {n: u for u, ns in _units(shapes, L).items() for n in ns}
    bad: list[str] = []
    got: dict[tuple[int, str], list[tuple[Fraction, Fraction, int]]] = {}
    for rank, ps in sw.local.items():
        for p in ps:
            got.setdefault((rank, p.name), []).append((p.lo, p.hi, rank))
    for (a, b), ps in sw.pairs.items():
        for p in ps:
            got.setdefault((b, p.name), []).append((p.lo, p.hi, a))
    for rank in range(layouts.num_gpus):
        for n in shapes:
            u = unit_of[n]
            lo, hi = layouts.held(sw.dst, n, u, rank)
            pieces = sorted(got.get((rank, n), []))
            pos = lo
            for a, b, sender in pieces:
                sa, sb = layouts.held(sw.src, n, u, sender)
                if not (sa <= a and b <= sb):
                    bad.append(f"{n} [{a},{b}) -> rank {rank}: sender {sender} holds only [{sa},{sb})")
                if a != pos:
                    bad.append(f"{n} rank {rank}: {'gap' if a > pos else 'overlap'} at {min(a, pos)}")
                pos = max(pos, b)
            if pos != hi:
                bad.append(f"{n} rank {rank}: covered up to {pos}, needs [{lo},{hi})")
    return bad


def _units(shapes: Mapping[str, tuple], L: int) -> dict[int, list[str]]:
    class _Named:  # unit_param_names only reads named_parameters()
        def named_parameters(self):
            return ((n, None) for n in shapes)

    return unit_param_names(_Named(), L)  # type: ignore[arg-type]


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


class TensorViews:
    """Slices of one rank's tensors of a layout, by fraction of the full tensor."""

    def __init__(self, layouts: Layouts, layout: str, rank: int, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.layouts, self.layout, self.rank, self.shapes = layouts, layout, rank, shapes
        L = layouts.num_layers
        self.unit_of = {n: u for u, ns in _units(shapes, L).items() for n in ns}
        self._held = {n: layouts.held(layout, n, self.unit_of[n], rank) for n in shapes}

    def __call__(self, tensors: Mapping[str, torch.Tensor], p: Piece) -> torch.Tensor:
        d = shard_dim(p.name)
        return fraction_slice(tensors[p.name], d, p.lo, p.hi, held=self._held[p.name], full=self.shapes[p.name][d])


class SwitchCache:
    """Switches built on first use and reused (as the authors' code caches plans after step 0)."""

    def __init__(self, layouts: Layouts, rank: int, shapes: Mapping[str, tuple[int, ...]],
                 policy: str = "bandwidth_greedy") -> None:
        self.layouts, self.rank, self.shapes, self.policy = layouts, rank, dict(shapes), policy
        self._switch: dict[tuple[str, str], Switch] = {}
        self._views: dict[str, TensorViews] = {}
        self.built = 0

    def views(self, layout: str) -> TensorViews:
        if layout not in self._views:
            self._views[layout] = TensorViews(self.layouts, layout, self.rank, self.shapes)
        return self._views[layout]

    def switch(self, src: str, dst: str) -> Switch:
        if (src, dst) not in self._switch:
            self._switch[(src, dst)] = plan_switch(self.layouts, src, dst, self.shapes, self.policy)
            self.built += 1
        return self._switch[(src, dst)]

    def summaries(self) -> dict[str, dict]:
        """``"from->to"`` -> the planner's summary, for every parameter switch built so far."""
        return {f"{k[0]}->{k[1]}": sw.summary for k, sw in self._switch.items() if k[0] != "grad"}

    def params(self, src: str, dst: str, src_t: Mapping, dst_t: Mapping, group=None) -> int:
        """Copy parameters ``src -> dst``."""
        return self.switch(src, dst).run(self.rank, src_t, dst_t, self.views(src), self.views(dst), group=group)

    def grads(self, strategy: Strategy, grads: Mapping, home_acc: Mapping, group=None) -> int:
        """Reduce a strategy's gradients over its DP group and add them into the home accumulator."""
        lay = layout_name(strategy)
        if strategy.dp == 1:  # complete already: each rank adds its own fraction (no traffic)
            sw = self.switch(lay, HOME)
        elif strategy.tp == 1:  # DP partials: reduce-scatter = transpose of the home -> DP all-gather
            key = ("grad", lay)
            if key not in self._switch:
                self._switch[key] = self.switch(HOME, lay).reversed()  # type: ignore[index]
            sw = self._switch[key]  # type: ignore[index]
        else:
            raise ConfigError(f"system.strategies: real mode switches gradients of (dp,1,1) or (1,tp,1) "
                              f"strategies, got {strategy}")
        return sw.run(self.rank, grads, home_acc, self.views(lay), self.views(HOME), add=True, group=group)
