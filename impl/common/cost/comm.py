"""Communication costs: pipeline P2P, ring all-reduce (TP and DP), and the per-link cost table
the pipeline simulator consumes.

Placement (Megatron's default order, tp fastest, then dp, then pp): the GPU of pipeline stage
p, data-parallel rank d, tensor rank t is global rank ``p·dp·tp + d·tp + t``, and node
``rank // gpus_per_node``. A pipeline link is intra-node only if every (d, t) pair of its two
stages shares a node; otherwise the slowest pair (inter-node) gates it. Each TP rank sends
its own copy of the activation over its own NIC, so a message is one send/recv of
``msg_bytes``. Every transfer is priced by :mod:`impl.common.collectives` at the step model's
link efficiencies (:func:`impl.common.megatron.derive.comm_efficiencies`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from impl.common import collectives as coll
from impl.common.api import ConfigError
from impl.common.collectives import same_node
from impl.common.hardware import HardwareProfile
from impl.common.megatron.derive import comm_efficiencies


def link_efficiencies(hw: HardwareProfile) -> dict:
    """The step model's link efficiencies for ``hw`` (keyword arguments of :func:`coll.collective`)."""
    return comm_efficiencies(hw)


def flow_rates(hw: HardwareProfile) -> tuple[float, float, float, float]:
    """One GPU-to-GPU flow (re-sharding, migration): (NVLink bytes/s, ONE NIC's bytes/s, their
    latencies) as :mod:`impl.common.collectives` prices a send/recv, at the step model's efficiencies."""
    eff = link_efficiencies(hw)
    intra = coll.collective(coll.CollOp.SEND_RECV, 1.0, hw, 2, 2, **eff)
    inter = coll.collective(coll.CollOp.SEND_RECV, 1.0, hw, 2, 1, **eff)
    return 1.0 / intra.bandwidth_s, 1.0 / inter.bandwidth_s, intra.latency_s, inter.latency_s


def ring_allreduce_time_s(nbytes: float, n: int, hw: HardwareProfile, ranks_per_node: Optional[int] = None) -> float:
    """All-reduce of ``nbytes`` over ``n`` ranks (``ranks_per_node`` per node, default packed) at
    the step model's link efficiencies (:mod:`impl.common.collectives`)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return coll.time_s(coll.CollOp.ALL_REDUCE, nbytes, hw, n, ranks_per_node, **link_efficiencies(hw))


def dp_allreduce_time_s(grad_bytes: float, dp: int, hw: HardwareProfile, ranks_per_node: Optional[int] = None,
                        slow_link_delay_s: float = 0.0) -> float:
    """Gradient ring all-reduce over ``dp`` ranks gated by one slow link (ADAPTRA's S5
    scenario [R], impl/adaptra/README.md).

    A ring runs 2(dp-1) synchronous steps, each sending one chunk over every ring link; the
    step ends when the slowest link delivers, so a per-message delay on one link is paid once
    per step: total = ring time + 2(dp-1)·delay.
    """
    if dp <= 1:
        return 0.0
    return ring_allreduce_time_s(grad_bytes, dp, hw, ranks_per_node) + 2 * (dp - 1) * slow_link_delay_s


def p2p_time_s(src_stage: int, dst_stage: int, msg_bytes: float, hw: HardwareProfile,
               tp: int = 1, dp: int = 1) -> float:
    """Base time of one pipeline message: a send/recv over NVLink, or across nodes over one NIC."""
    if msg_bytes <= 0:
        return 0.0
    k = 2 if same_node(src_stage, dst_stage, tp, dp, hw.gpus_per_node) else 1
    return coll.time_s(coll.CollOp.SEND_RECV, msg_bytes, hw, 2, k, **link_efficiencies(hw))


@dataclass(frozen=True)
class LinkCosts:
    """What the pipeline simulator needs to price a message on link (i, i+1).

    ``p2p_s[i]`` is the base (undelayed) time of one message on link (i, i+1), both directions.
    ``host_link_bw_bytes_per_s`` prices the D2H/H2D copies of the delegated path (inf = free).
    """

    p2p_s: tuple[float, ...]
    msg_bytes: float = 0.0
    host_link_bw_bytes_per_s: float = math.inf

    def __post_init__(self) -> None:
        bad = [t for t in self.p2p_s if not t >= 0.0]
        if bad:
            raise ConfigError(f"LinkCosts.p2p_s must be >= 0 seconds, got {bad[0]}")
        if not self.host_link_bw_bytes_per_s > 0:
            raise ConfigError(f"LinkCosts.host_link_bw_bytes_per_s must be > 0, got {self.host_link_bw_bytes_per_s}")

    @property
    def copy_s(self) -> float:
        """One host<->device copy of a message (delegated path)."""
        return self.msg_bytes / self.host_link_bw_bytes_per_s

    @classmethod
    def uniform(cls, stages: int, p2p_s: float = 0.0, msg_bytes: float = 0.0,
                host_link_bw_bytes_per_s: float = math.inf) -> "LinkCosts":
        return cls((float(p2p_s),) * max(stages - 1, 0), float(msg_bytes), host_link_bw_bytes_per_s)

    @classmethod
    def from_hardware(cls, stages: int, msg_bytes: float, hw: HardwareProfile, tp: int = 1, dp: int = 1) -> "LinkCosts":
        p2p = tuple(p2p_time_s(i, i + 1, msg_bytes, hw, tp, dp) for i in range(stages - 1))
        host_bw = hw.host_link_bw_bytes_per_s if hw.host_link_bw_bytes_per_s > 0 else math.inf
        return cls(p2p, float(msg_bytes), host_bw)
