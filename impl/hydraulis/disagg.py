"""Optimization–propagation disaggregation (paper abstract; the authors' code) over ``W`` torch.distributed ranks.

The optimizer layout is fixed for the whole run: ZeRO-1-like over all ranks (os_dp = W,
os_tp = os_pp = 1), rank ``o`` holding the fp32 master weights and Adam state of the fraction
``[o/W, (o+1)/W)`` of every tensor, cut along
:func:`~impl.common.parallel.tensor_parallel.shard_dim` (the same cut as
:func:`~impl.common.parallel.tensor_parallel.cut_state_dict`).

Each step runs a *compute strategy*: replicas over consecutive ranks (:class:`Strategy`), a
replica of ``tp`` ranks running explicit TP. Per step:
1. :meth:`OptimizerLayout.gather` all-gathers the master shards into the full fp32 weights
   (a copy of the bits: the round trip optimizer -> compute -> optimizer is lossless, and the
   master shards are never written from a compute copy, so a strategy switch cannot move them);
   each replica cuts its compute copy from it (:func:`compute_shards` for TP).
2. The replicas run forward and backward on their own micro-batches, loss normalised by the
   step's global token count, so the replicas' gradients add up to the step's gradient.
3. :meth:`OptimizerLayout.reduce` returns the gradients to the optimizer layout, summing over
   replicas (the DP reduction): TP rank ``t`` of a replica of ``tp`` ranks contributes the
   fraction ``[t/tp, (t+1)/tp)`` of every gradient (its TP shard of a split weight; the same
   fraction of a replicated weight, whose gradient every TP rank holds whole), so a rank's
   contribution is one fraction interval, uniform over tensors, and owner ``o`` receives from
   each active rank the intersection with its own fraction, as one flat point-to-point message.
   All-DP strategies get a reduce-scatter, a world-wide TP replica moves nothing. A replica
   with no data sends nothing and is named in :attr:`ReduceLog.excluded`: it is left out of
   the sum explicitly, never added as zeros.
4. :meth:`OptimizerLayout.step`: one Adam step on the shards.

Why not HotSPa's switch planner (:mod:`impl.hotspa.switching`): systems do not import each
other; with one fixed optimizer layout every transfer is a fraction intersection, so the
plan is the few lines of :func:`reduce_pieces`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from impl.common.api import ConfigError
from impl.common.parallel.tensor_parallel import compute_dim, compute_shards, fraction_slice, shard_dim


@dataclass(frozen=True)
class Strategy:
    """Compute strategy: ``tps[r]`` ranks for replica r, replicas on consecutive ranks."""

    tps: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.tps or any(t < 1 for t in self.tps):
            raise ConfigError(f"strategy: every replica needs >= 1 rank, got tp {list(self.tps)}")

    @property
    def world(self) -> int:
        return sum(self.tps)

    def ranks(self, r: int) -> tuple[int, ...]:
        lo = sum(self.tps[:r])
        return tuple(range(lo, lo + self.tps[r]))

    def place(self, rank: int) -> tuple[int, int]:
        """(replica, TP rank) of ``rank``."""
        lo = 0
        for r, t in enumerate(self.tps):
            if rank < lo + t:
                return r, rank - lo
            lo += t
        raise ValueError(f"rank {rank} is outside strategy tp {list(self.tps)} ({self.world} ranks)")

    def held(self, rank: int) -> tuple[Fraction, Fraction]:
        """The gradient fraction ``rank`` contributes (uniform over tensors)."""
        r, t = self.place(rank)
        return Fraction(t, self.tps[r]), Fraction(t + 1, self.tps[r])


def owned(rank: int, world: int) -> tuple[Fraction, Fraction]:
    return Fraction(rank, world), Fraction(rank + 1, world)


def _meet(a: tuple[Fraction, Fraction], b: tuple[Fraction, Fraction]) -> Optional[tuple[Fraction, Fraction]]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def reduce_pieces(strategy: Strategy, active: Sequence[bool]) -> dict[tuple[int, int], tuple[Fraction, Fraction]]:
    """``(sender, owner) -> fraction`` of every tensor the sender adds into the owner's shard
    (sender == owner: kept in place). Ranks of an inactive replica appear nowhere."""
    W = strategy.world
    if len(active) != len(strategy.tps):
        raise ValueError(f"active: {len(active)} flags for {len(strategy.tps)} replicas")
    out = {}
    for p in range(W):
        if not active[strategy.place(p)[0]]:
            continue
        for o in range(W):
            m = _meet(strategy.held(p), owned(o, W))
            if m is not None:
                out[(p, o)] = m
    return out


def check_shardable(shapes: Mapping[str, Sequence[int]], world: int, field: str = "workload.num_gpus") -> None:
    for n, s in shapes.items():
        d = shard_dim(n)
        if s[d] % world:
            raise ConfigError(f"{field}: {world} optimizer shards do not divide {n} ({s[d]} along dim {d})")


@dataclass
class ReduceLog:
    excluded: list[int] = field(default_factory=list)  # replicas left out of the sum (no data)
    sent_bytes: int = 0
    recv_bytes: int = 0


class OptimizerLayout:
    """This rank's master fp32 shards and their Adam state (the fixed layout)."""

    def __init__(self, full: Mapping[str, torch.Tensor], rank: int, world: int, lr: float) -> None:
        self.rank, self.world = rank, world
        self.names = list(full)
        self.shapes = {n: tuple(v.shape) for n, v in full.items()}
        check_shardable(self.shapes, world)
        lo, hi = owned(rank, world)
        self.params = {n: torch.nn.Parameter(fraction_slice(v.detach(), shard_dim(n), lo, hi).clone())
                       for n, v in full.items()}
        self.opt = torch.optim.Adam(list(self.params.values()), lr=lr)
        self.device = next(iter(self.params.values())).device  # the full tensors' (the rank's device)
        self.steps = 0

    def _piece_shape(self, n: str, frac: tuple[Fraction, Fraction]) -> tuple[int, ...]:
        s = list(self.shapes[n])
        d = shard_dim(n)
        s[d] = int((frac[1] - frac[0]) * s[d])
        return tuple(s)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def gather(self) -> dict[str, torch.Tensor]:
        """The full fp32 weights on every rank (all-gather of the flat shards)."""
        flat = torch.cat([self.params[n].detach().reshape(-1) for n in self.names])
        parts = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(parts, flat)
        out = {}
        for o in range(self.world):
            off = 0
            for n in self.names:
                shape = self._piece_shape(n, owned(o, self.world))
                k = int(torch.Size(shape).numel())
                out.setdefault(n, []).append(parts[o][off:off + k].view(shape))
                off += k
        return {n: torch.cat(out[n], dim=shard_dim(n)) for n in self.names}

    def _contribution(self, grads: Mapping[str, torch.Tensor], strategy: Strategy,
                      frac: tuple[Fraction, Fraction]) -> torch.Tensor:
        held = strategy.held(self.rank)
        r, _ = strategy.place(self.rank)
        tp = strategy.tps[r]
        pieces = []
        for n in self.names:
            g, d = grads[n], shard_dim(n)
            # A TP rank holds only its shard of a split weight; a replicated weight whole.
            h = held if (tp > 1 and compute_dim(n) is not None) else (Fraction(0), Fraction(1))
            pieces.append(fraction_slice(g, d, frac[0], frac[1], held=h, full=self.shapes[n][d]).reshape(-1))
        return torch.cat(pieces)

    def reduce(self, grads: Optional[Mapping[str, torch.Tensor]], strategy: Strategy,
               active: Sequence[bool]) -> ReduceLog:
        """Sum the active replicas' gradients into this rank's shard (``grads`` None on a rank
        of an inactive replica) and leave it in ``.grad``."""
        if strategy.world != self.world:
            raise ValueError(f"strategy tp {list(strategy.tps)} covers {strategy.world} ranks, world is {self.world}")
        if not any(active):
            raise ValueError("reduce: no replica has data; a step needs at least one")
        log = ReduceLog(excluded=[r for r, a in enumerate(active) if not a])
        me_active = active[strategy.place(self.rank)[0]]
        if me_active == (grads is None):
            raise ValueError(f"rank {self.rank}: gradients {'missing' if grads is None else 'given'} on "
                             f"{'an active' if me_active else 'an idle'} replica")
        pieces = reduce_pieces(strategy, active)
        reqs, inbox = [], {}
        for (p, o), frac in sorted(pieces.items()):
            if p == self.rank and o != self.rank:
                buf = self._contribution(grads, strategy, frac)
                log.sent_bytes += buf.numel() * buf.element_size()
                reqs.append(dist.isend(buf, dst=o))
            elif o == self.rank and p != self.rank:
                n = sum(int(torch.Size(self._piece_shape(k, frac)).numel()) for k in self.names)
                inbox[p] = (frac, torch.empty(n, dtype=torch.float32, device=self.device))
                reqs.append(dist.irecv(inbox[p][1], src=p))
        for q in reqs:
            q.wait()
        lo, hi = owned(self.rank, self.world)
        total = {n: torch.zeros(self._piece_shape(n, (lo, hi)), device=self.device) for n in self.names}
        # Sum in sender order, the same on every run: deterministic.
        for p in sorted(s for (s, o) in pieces if o == self.rank):
            frac = pieces[(p, self.rank)]
            flat = self._contribution(grads, strategy, frac) if p == self.rank else inbox[p][1]
            log.recv_bytes += 0 if p == self.rank else flat.numel() * 4
            off = 0
            for n in self.names:
                shape = self._piece_shape(n, frac)
                k = int(torch.Size(shape).numel())
                d = shard_dim(n)
                fraction_slice(total[n], d, frac[0], frac[1], held=(lo, hi), full=self.shapes[n][d]).add_(
                    flat[off:off + k].view(shape))
                off += k
        for n, p in self.params.items():
            p.grad = total[n]
        return log

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1


def compute_copy(full: Mapping[str, torch.Tensor], strategy: Strategy, rank: int) -> dict[str, torch.Tensor]:
    """This rank's compute weights under ``strategy`` (whole for tp 1, TP shards otherwise)."""
    r, t = strategy.place(rank)
    tp = strategy.tps[r]
    return {n: v for n, v in full.items()} if tp == 1 else compute_shards(full, t, tp)


def to_optimizer_layout(compute: Mapping[str, torch.Tensor], strategy: Strategy, rank: int,
                        shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """The optimizer-layout shard of ``rank`` cut back out of its own compute copy where that
    copy holds it (tp 1, or a world-wide TP replica): the round-trip check."""
    W = strategy.world
    r, t = strategy.place(rank)
    tp = strategy.tps[r]
    lo, hi = owned(rank, W)
    held = strategy.held(rank)
    out = {}
    for n, v in compute.items():
        h = held if (tp > 1 and compute_dim(n) is not None) else (Fraction(0), Fraction(1))
        if not (h[0] <= lo and hi <= h[1]):
            raise ValueError(f"{n}: rank {rank}'s compute copy holds fraction {h}, not its shard [{lo}, {hi})")
        d = shard_dim(n)
        out[n] = fraction_slice(v, d, lo, hi, held=h, full=shapes[n][d]).clone()
    return out
