"""Sim-mode prices shared by every Hydraulis policy and baseline: the authors' cost model
(`examples/hydraulis/strategy/`) and disaggregation, priced as ``impl/hydraulis/README.md``
("Design choices for the [R] details") states.

One step = the slowest replica's 1F1B time over its micro-batches + the parameter/gradient
exchange with the optimizer layout. Every policy is priced by these functions on the same
cost objects, so a ratio between two policies comes from their plans alone.

- Micro-batch time ``T_mb = Σ_i (a s_i² + b s_i) + c + b·pad`` [R]: alignment (or static-shape)
  padding costs its linear work only: it is one extra segment that varlen attention masks.
  A padded-to-max row (mode 0) is priced as a real sequence of the row length.
- Exchange [R] (disaggregation, and Megatron's distributed optimizer alike): each GPU of a
  replica of ``g = tp·pp`` GPUs receives its bf16 parameter shard (2 B/param) and returns its
  fp32 gradient shard (4 B/param): ``6·|θ|/g·(R − 1)/R`` bytes over the step model's inter-node
  bus bandwidth (intra-node when the job fits in one node), ``R`` = replicas (the ring factor of the
  reduce-scatter / all-gather; 0 for a single replica).
- Overlap [R] (the authors' overlap is not known; README "Step price"), one rule for every policy:
  communication hides behind the compute of the micro-batch it accompanies. The exchange
  overlaps one micro-batch per replica (gradients with the last backward, parameters with the
  first forward, as Megatron's distributed optimizer does): a replica's exposed exchange is
  ``max(0, exchange − max_j T_mb,j)``; ZeRO-3's per-micro-batch gathers overlap their own
  micro-batch (``max(T_mb, gather)``). The step is the slowest replica's compute + exposed
  exchange. The optimizer update itself is the same for every policy and left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from impl.common.cost.transformer import model_params
from impl.common.varlen.packing import MicroBatch

from impl.hydraulis.cost.strategy import ReplicaCost
from impl.common import collectives as coll
from impl.common.cost.comm import flow_rates, link_efficiencies


def link_bw(hw, num_gpus: int) -> float:
    """Achieved bandwidth of one GPU's flow in the switch / ZeRO-3 gathers: NVLink when the job fits
    in one node, else ONE NIC (:func:`impl.common.cost.comm.flow_rates`)."""
    intra_bw, inter_bw, _, _ = flow_rates(hw)
    return intra_bw if num_gpus <= hw.gpus_per_node else inter_bw


def mb_time_ms(r: ReplicaCost, lengths: Sequence[int], pad_tokens: int = 0) -> float:
    if not len(lengths):
        return 0.0  # an empty placeholder (equal micro-batch counts) runs no compute
    return r.mb_time(lengths) + r.b * pad_tokens


def rank_time_ms(r: ReplicaCost, mbs: Sequence[tuple[Sequence[int], int]]) -> float:
    """1F1B time of one replica's micro-batches, each ``(lengths, pad tokens)``."""
    ts = [mb_time_ms(r, ls, pad) for ls, pad in mbs if len(ls)]
    return sum(ts) + (r.pp - 1) * max(ts) if ts else 0.0


def from_micro_batches(mbs: Sequence[MicroBatch]) -> list[tuple[tuple[int, ...], int]]:
    """Substrate micro-batches -> (lengths, pad tokens); one-per-row layouts price each row
    as a sequence of the row length."""
    out = []
    for mb in mbs:
        if mb.one_per_row:
            out.append(((mb.row_len,) * mb.num_seqs, mb.padded_len - mb.row_len * mb.num_seqs))
        else:
            out.append((mb.lengths, mb.padded_len - mb.num_tokens))
    return out


def aligned(lengths: Sequence[int], align: int) -> tuple[tuple[int, ...], int]:
    tok = int(sum(lengths))
    return tuple(int(x) for x in lengths), (-tok) % align


def exchange_one_s(model, hw, num_gpus: int, r: ReplicaCost, R: int) -> float:
    if R <= 1:
        return 0.0
    # each GPU gathers its peers' shards across the R replicas (one GPU per replica per node at
    # most once the job spans nodes)
    k = R if num_gpus <= hw.gpus_per_node else coll.group_ranks_per_node(R, r.gpus, hw.gpus_per_node)
    c = coll.collective(coll.CollOp.ALL_GATHER, 6.0 * float(model_params(model)) / r.gpus, hw, R, k,
                        **link_efficiencies(hw))
    return c.bandwidth_s


def exchange_s(model, hw, num_gpus: int, replicas: Sequence[ReplicaCost]) -> float:
    """The un-overlapped exchange of the slowest replica (s)."""
    return max(exchange_one_s(model, hw, num_gpus, r, len(replicas)) for r in replicas)


def finish(model, hw, num_gpus: int, replicas: Sequence[ReplicaCost],
           per_replica: Sequence[Sequence[tuple[Sequence[int], int]]]) -> tuple[float, float]:
    """(compute s, exposed exchange s) of a step: compute = the slowest replica's 1F1B time;
    exposed = step − compute with each replica's exchange overlapping its largest micro-batch."""
    R = len(replicas)
    comp, step = 0.0, 0.0
    for r, mbs in zip(replicas, per_replica):
        t = rank_time_ms(r, mbs) / 1e3
        ts = [mb_time_ms(r, ls, pad) for ls, pad in mbs if len(ls)]
        window = max(ts) / 1e3 if ts else 0.0
        comp = max(comp, t)
        step = max(step, t + max(0.0, exchange_one_s(model, hw, num_gpus, r, R) - window))
    return comp, step - comp


def switch_s(model, hw, num_gpus: int, dst: ReplicaCost) -> float:
    """HotSPa-like hot switch [R]: bf16 params and fp32 grads re-laid for the next strategy."""
    p = float(model_params(model))
    return 6.0 * p / dst.gpus / link_bw(hw, num_gpus)


@dataclass
class StepPrice:
    compute_s: float
    exchange_s: float
    switch_s: float = 0.0
    plan_time_s: float = 0.0
    candidate: str = ""
    statuses: dict = None  # type: ignore[assignment]
    micro_batches: int = 0
    # per-iteration terms outside the micro-batches (s): the step model's iteration overhead
    # (every policy pays it once a step)
    overhead_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exchange_s + self.switch_s + self.overhead_s
