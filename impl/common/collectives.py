"""NCCL-style collectives priced from a hardware profile's links and the group's placement.

The one place the harness writes a ring factor or a latency rule: every pricer (the Megatron step
model, the cost models, the system simulators) asks this module what an all-reduce, all-gather,
reduce-scatter, all-to-all or send/recv of ``nbytes`` over ``ranks`` GPUs, ``ranks_per_node`` on
each node, costs.

Links (``HardwareProfile``): NVLink inside a node, ``intra_node_bw_bytes_per_s`` per GPU per
direction; the network, ``inter_node_bw_bytes_per_s`` per NIC per direction, ``nics_per_node``
NICs on a node (0 = one per GPU). Each link's achieved rate is its datasheet rate x an
efficiency in (0, 1] (``intra_efficiency``, ``inter_efficiency``; default the profile's
``comm_efficiency``). NCCL reaches ~0.8 of NVLink (github.com/NVIDIA/nccl-tests/issues/309: 369 of 450 GB/s on
H100) and ~0.94-0.96 of an IB NIC (SimAI ``astra-sim-alibabacloud/.../calbusbw.h``: CX6_BW 23.5
of 25 GB/s, CX7_BW 48.5 of 50); below ~0.5 is a misconfigured link, not an efficiency.

Algorithms (nccl-tests ``doc/PERFORMANCE.md`` for the bus-bandwidth convention; NCCL's tuning
model ``src/graph/tuning.cc`` for the latencies):
- ring (all-reduce, all-gather, reduce-scatter): every rank sends ``f x S`` through its ring
  link, ``f`` = 2(n-1)/n for all-reduce and (n-1)/n for all-gather / reduce-scatter (``S`` the
  whole buffer). One node: NVLink. Across nodes a pipelined multi-rail ring: NCCL builds one
  ring per NIC, each leaving the node on its own rail, so the bus bandwidth is bounded by
  min(NVLink x k/(k-1), rails x NIC) with k ranks per node (k = 1: one NIC; the k/(k-1): of
  the k ranks of a node only k-1 hops per ring stay on NVLink). Latency: 2(n-1) (all-reduce)
  or n-1 steps, each the slowest hop's latency (the network's once the ring leaves a node);
- tree (all-reduce across nodes, NCCL's pick for small messages): reduce up and broadcast down
  a chain of k-1 NVLink hops and log2(nodes) network hops; the whole buffer crosses each
  link up and down (factor 2), so it wins on latency only. Priced as the faster of the two;
- all-to-all: each rank's (n-k)/n share to the other nodes over its own NIC (no rail
  aggregation: NCCL's all-to-all is grouped send/recv, each peer's bytes on one path), its
  (k-1)/n share over NVLink at the same time; one hop of latency (the sends are concurrent);
- send/recv: one NVLink, or across nodes one NIC; one hop of latency.

Results follow nccl-tests: ``algbw`` = S / t; ``busbw`` = algbw x 2(n-1)/n (all-reduce),
x (n-1)/n (all-gather, reduce-scatter, all-to-all), x 1 (send/recv).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

from impl.common.errors import ConfigError
from impl.common.hardware import HardwareProfile


class CollOp(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"


class Link(StrEnum):
    NVLINK = "nvlink"
    NIC = "nic"


class Bound(StrEnum):
    NVLINK = "nvlink"
    NIC = "nic"
    LATENCY = "latency"


@dataclass(frozen=True)
class CollectiveCost:
    """One collective: ``time_s`` = ``bandwidth_s`` + ``latency_s``; ``link`` the link that bounds
    the bandwidth seconds; ``bound`` that link, or ``latency`` where latency seconds dominate."""

    op: CollOp
    nbytes: float
    time_s: float
    bandwidth_s: float
    latency_s: float
    link: Link
    bound: Bound
    algorithm: str
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float


@dataclass(frozen=True)
class GroupPlacement:
    """A group of ``ranks`` GPUs, ``ranks_per_node`` of them on each of ``nodes`` nodes."""

    ranks: int
    ranks_per_node: int

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node


def bus_factor(op: CollOp, n: int) -> float:
    """nccl-tests' busbw / algbw (``doc/PERFORMANCE.md``): the bytes each rank's link carries per
    byte of the buffer on a ring."""
    if n <= 1:
        return 0.0 if op != CollOp.SEND_RECV else 1.0
    if op == CollOp.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op == CollOp.SEND_RECV:
        return 1.0
    return (n - 1) / n


def group_ranks_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """Ranks per node of a group of ``size`` ranks ``stride`` apart in global rank order (Megatron:
    tp stride 1, dp stride tp, pp stride tp x dp), the group's first rank at a node's start. A
    group its nodes split unevenly is priced at the largest even split below (the fuller node's
    ranks wait for the emptier's NICs)."""
    if size < 1 or stride < 1 or gpus_per_node < 1:
        raise ConfigError(f"group placement: size, stride and gpus_per_node must be >= 1, got {size}, {stride}, {gpus_per_node}")
    k = max(1, min(size, gpus_per_node // stride))
    while size % k:
        k -= 1
    return k


def _nodes_of(rank_base: int, width: int, gpus_per_node: int) -> list[int]:
    return [(rank_base + k) // gpus_per_node for k in range(width)]


def same_node(src_stage: int, dst_stage: int, tp: int, dp: int, gpus_per_node: int) -> bool:
    """True if every (dp, tp) rank of pipeline stage ``src_stage`` sits on the node of its peer in
    ``dst_stage``, ranks in Megatron's default order (tp fastest, then dp, then pp)."""
    width = tp * dp
    return _nodes_of(src_stage * width, width, gpus_per_node) == _nodes_of(dst_stage * width, width, gpus_per_node)


def _op(op) -> CollOp:
    try:
        return CollOp(op)
    except ValueError:
        raise ConfigError(f"collective op: {op!r} is not one of {', '.join(o.value for o in CollOp)}") from None


def _eff(name: str, value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{name}: must be in (0, 1] (a fraction of the link's datasheet rate), got {value}")
    return float(value)


def placement(hw: HardwareProfile, ranks: int, ranks_per_node: Optional[int] = None) -> GroupPlacement:
    """The checked placement: ``ranks_per_node`` defaults to as many as fit on a node."""
    if not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"collective ranks: must be an integer >= 1, got {ranks!r}")
    k = min(ranks, hw.gpus_per_node) if ranks_per_node is None else ranks_per_node
    if not isinstance(k, int) or not 1 <= k <= min(ranks, hw.gpus_per_node):
        raise ConfigError(f"collective ranks_per_node: must be in [1, min(ranks={ranks}, gpus_per_node="
                          f"{hw.gpus_per_node})], got {k!r}")
    if ranks % k:
        raise ConfigError(f"collective ranks_per_node: {k} does not divide ranks={ranks}")
    return GroupPlacement(ranks, k)


def rails(hw: HardwareProfile, k: int) -> int:
    """NICs a node's k ranks drive at once: one per GPU (``nics_per_node`` 0), else at most the node's."""
    return k if hw.nics_per_node <= 0 else max(1, min(k, hw.nics_per_node))


def _rates(hw: HardwareProfile, intra_efficiency: Optional[float], inter_efficiency: Optional[float]):
    ei = _eff("intra_efficiency", hw.comm_efficiency if intra_efficiency is None else intra_efficiency)
    ee = _eff("inter_efficiency", hw.comm_efficiency if inter_efficiency is None else inter_efficiency)
    return hw.intra_node_bw_bytes_per_s * ei, hw.inter_node_bw_bytes_per_s * ee


def _need(hw: HardwareProfile, field: str) -> None:
    if not getattr(hw, field) > 0:
        raise ConfigError(f"hardware {hw.name}: {field} must be > 0 to price a collective, got {getattr(hw, field)}")


def link_rate(op, hw: HardwareProfile, ranks: int, ranks_per_node: Optional[int] = None, *,
              intra_efficiency: Optional[float] = None, inter_efficiency: Optional[float] = None
              ) -> tuple[float, Link, float]:
    """The bandwidth-bound algorithm (ring; all-to-all and send/recv as above) of ``op``:
    (seconds per byte of the buffer, the link that bounds it, latency seconds). Linear in the
    bytes, for pricers that price arrays of sizes (:mod:`impl.common.megatron.step`)."""
    op = _op(op)
    pl = placement(hw, ranks, ranks_per_node)
    n, k, nodes = pl.ranks, pl.ranks_per_node, pl.nodes
    if op == CollOp.SEND_RECV and n != 2:
        raise ConfigError(f"collective send_recv: ranks must be 2 (a sender and a receiver), got {n}")
    if n == 1:
        return 0.0, Link.NVLINK, 0.0
    _need(hw, "intra_node_bw_bytes_per_s")
    nv, nic = _rates(hw, intra_efficiency, inter_efficiency)
    lat_in, lat_out = hw.intra_node_latency_s, hw.inter_node_latency_s
    if nodes > 1:
        _need(hw, "inter_node_bw_bytes_per_s")
    if op == CollOp.SEND_RECV:
        if nodes == 1:
            return 1.0 / nv, Link.NVLINK, lat_in
        return 1.0 / nic, Link.NIC, lat_out
    f = bus_factor(op, n)
    if op == CollOp.ALL_TO_ALL:
        intra_s = (k - 1) / n / nv
        if nodes == 1:
            return intra_s, Link.NVLINK, lat_in
        inter_s = (n - k) / n / (nic * rails(hw, k) / k)
        return (inter_s, Link.NIC, lat_out) if inter_s >= intra_s else (intra_s, Link.NVLINK, lat_out)
    steps = 2 * (n - 1) if op == CollOp.ALL_REDUCE else n - 1
    if nodes == 1:
        return f / nv, Link.NVLINK, steps * lat_in
    nv_bound = nv * k / (k - 1) if k > 1 else math.inf
    nic_bound = nic * rails(hw, k)
    if nic_bound <= nv_bound:
        return f / nic_bound, Link.NIC, steps * lat_out
    return f / nv_bound, Link.NVLINK, steps * lat_out


def _tree_all_reduce(hw: HardwareProfile, pl: GroupPlacement, nv: float, nic: float) -> tuple[float, Link, float]:
    k, nodes = pl.ranks_per_node, pl.nodes
    nv_bound = nv if k > 1 else math.inf
    nic_bound = nic * rails(hw, k)
    link = Link.NIC if nic_bound <= nv_bound else Link.NVLINK
    lat = 2.0 * ((k - 1) * hw.intra_node_latency_s + math.ceil(math.log2(nodes)) * hw.inter_node_latency_s)
    return 2.0 / min(nic_bound, nv_bound), link, lat


def collective(op, nbytes: float, hw: HardwareProfile, ranks: int, ranks_per_node: Optional[int] = None, *,
               intra_efficiency: Optional[float] = None, inter_efficiency: Optional[float] = None) -> CollectiveCost:
    """``op`` over ``nbytes`` (all-gather / reduce-scatter: the whole gathered buffer; all-to-all:
    one rank's send buffer) on ``ranks`` GPUs, ``ranks_per_node`` per node (default: packed)."""
    op = _op(op)
    if not nbytes >= 0 or math.isinf(nbytes):
        raise ConfigError(f"collective nbytes: must be a finite number >= 0, got {nbytes!r}")
    pl = placement(hw, ranks, ranks_per_node)
    per_byte, link, lat = link_rate(op, hw, ranks, pl.ranks_per_node, intra_efficiency=intra_efficiency,
                                    inter_efficiency=inter_efficiency)
    algorithm = "p2p" if op == CollOp.SEND_RECV else "ring" if op != CollOp.ALL_TO_ALL else "pairwise"
    if op == CollOp.ALL_REDUCE and pl.nodes > 1:
        tree = _tree_all_reduce(hw, pl, *_rates(hw, intra_efficiency, inter_efficiency))
        if tree[0] * nbytes + tree[2] < per_byte * nbytes + lat:
            per_byte, link, lat = tree
            algorithm = "tree"
    if pl.ranks == 1 or nbytes == 0:
        return CollectiveCost(op, float(nbytes), 0.0, 0.0, 0.0, link, Bound(link.value), "none", math.inf, math.inf)
    bw_s = per_byte * nbytes
    t = bw_s + lat
    algbw = nbytes / t
    return CollectiveCost(op, float(nbytes), t, bw_s, lat, link, Bound.LATENCY if lat > bw_s else Bound(link.value),
                          algorithm, algbw, algbw * bus_factor(op, pl.ranks))


def time_s(op, nbytes: float, hw: HardwareProfile, ranks: int, ranks_per_node: Optional[int] = None, **eff) -> float:
    """Seconds of :func:`collective` (0 for one rank or no bytes)."""
    return collective(op, nbytes, hw, ranks, ranks_per_node, **eff).time_s
