"""``ckpt_recovery_peer`` in the sim (README "Peer memory"): our partition-agnostic files also held in the
host memory of ``k`` other nodes (``sim.peer_copies``), restored with the same read plan.

Two tiers from one snapshot (the D2H copy overlapped with the next step, as ours):
- **peer tier**: after the snapshot, every rank file the save writes (lowest owner, as on
  storage) is sent to its k holders (:func:`impl.common.checkpoint.peer.placement`: never the
  owner's node, spread over the others). Per node: max(bytes sent, bytes received) over the
  node's NICs (``PAPER_PROFILES["network"]``, 400 GB/s) + one request per received file. The
  copy shares those NICs with training, on a lower-priority InfiniBand service level (Gemini
  schedules its copies into training's idle network time the same way): training's own
  inter-node traffic (DP gradient sync across nodes, each micro-batch's sends across a
  pipeline boundary between nodes: ``busy_frac`` of a step, from the iteration cost model)
  keeps priority, so the copy gets only the idle share and takes wire / (1 - busy_frac), and
  each of training's inter-node transfers during the copy waits behind at most one packet
  already on the wire (``IB_MTU_BYTES`` at a GPU's NIC rate): that wait x transfers per step
  x the steps the copy spans is the copy's stall on training. Interval: Young/Daly on that
  stall, no shorter than the lag or a step (skip-not-wait); a peer commit is "done" when its
  last holder committed: lag = snapshot + copy.
  A loss at a uniform phase falls back to the newest *copied* commit: the window in which a
  fresh commit has no peer copy yet is the lag (rework = interval / 2 + lag, sim/cost.py).
  The owner's node keeps its own files too (its own holder; written from the snapshot by a
  host memcpy that overlaps the wire copy and is shorter: not priced).
- **storage tier**: ours unchanged (async, Young/Daly, written from its own snapshot buffer),
  the fallback.
Host memory per node: training's own host memory + its snapshot buffers + 2 x the bytes it
holds, own and peers' files (the committed copy and the one being copied in: the double
buffer that keeps a commit readable while the next one is copied). Over
``host_mem_bytes_per_node``: refused in one line.
Load: every needed file with a live holder (its owner's node or a peer) is read from one (the reader's bytes split over a
file's live holders; a holder serves all its readers through its NICs); the slowest of the
holders' send and the readers' receive bounds it, plus the slowest reader's requests x the
network latency. A reader on a holder's node is priced through the NIC too (not waived).
If some needed file has no live copy (its owner's node and its k peers all down, or a
correlated loss, ``peer_correlated_frac``, taking every copy of each file that had one on a
dead node), the load falls back to the storage tier's newest commit,
every slice from storage (a mix would load two different steps), with that tier's rework.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet

from impl.common.checkpoint.peer import HostMemory, check_host_memory, holders, placement
from impl.common.parallel.cost import HybridCostModel, iteration_cost
from impl.common.parallel.plan import Plan
from impl.common.storage.emulator import PAPER_PROFILES

from impl.ckpt_recovery.sim.cost import SaveCost, _per_node_counts, _rank_nodes, young_daly_s
from impl.ckpt_recovery.sim.checkpoint_io import CheckpointIO

NET = PAPER_PROFILES["network"]
IB_MTU_BYTES = 4096  # InfiniBand's largest MTU: what a higher-priority packet can wait behind
MAX_BUSY = 0.95  # a copy always gets some idle share (a step's compute never overlaps every byte)


def place(io: CheckpointIO, saved: Plan, k: int, num_nodes: int, own: bool = True) -> dict[str, tuple[int, ...]]:
    """file -> its holder nodes (``own``: the owner's node first, then its k peers)."""
    nodes = _rank_nodes(saved)
    fn = {f: nodes[r] for f, r in io.file_ranks(saved).items()}
    sizes = _file_bytes(io, saved)
    return holders(fn, k, num_nodes, sizes) if own else placement(fn, k, num_nodes, sizes)


def _file_bytes(io: CheckpointIO, saved: Plan) -> dict[str, float]:
    rb = io.save_ours(saved).rank_bytes
    return {f: rb[r] for f, r in io.file_ranks(saved).items()}


def host_memory(io: CheckpointIO, saved: Plan, k: int, num_nodes: int, rank_state: float, knobs) -> list[HostMemory]:
    """Per node: training's host memory, its snapshot buffers (``rank_state`` per GPU: the
    storage tier's source, as ours) and 2 x the files it holds (its own and its peers')."""
    fb = _file_bytes(io, saved)
    held = {n: 0.0 for n in range(num_nodes)}
    for f, hs in place(io, saved, k, num_nodes).items():
        for h in hs:
            held[h] += fb[f]
    per_node = _per_node_counts(saved)
    return [HostMemory(n, knobs.train_host_bytes_per_gpu * per_node.get(n, 0), rank_state * per_node.get(n, 0),
                       held[n], 2) for n in range(num_nodes)]


def check(io: CheckpointIO, saved: Plan, k: int, num_nodes: int, rank_state: float, knobs) -> None:
    check_host_memory(host_memory(io, saved, k, num_nodes, rank_state, knobs), knobs.host_mem_bytes_per_node,
                      "system.sim.host_mem_bytes_per_node")


def nic_traffic(plan: Plan, cm: HybridCostModel) -> tuple[float, int]:
    """(share of a step in which training's own traffic uses the inter-node NICs, its
    inter-node transfers per step): the DP gradient sync when replicas span nodes, plus each
    micro-batch's activation and gradient sends across a pipeline boundary between nodes."""
    it = iteration_cost(plan, [1.0] * plan.num_gpus, cm)
    replica_nodes = {plan.groups[p.groups[0]].node for p in plan.pipelines}
    syncs = plan.dp > 1 and len(replica_nodes) > 1
    p2p, transfers = 0.0, 0
    for p in plan.pipelines:
        cross = sum(1 for j in range(p.num_stages - 1)
                    if plan.groups[p.groups[j]].node != plan.groups[p.groups[j + 1]].node)
        p2p = max(p2p, 2.0 * cross * p.micro_batches * cm.p2p_s(False))
        transfers = max(transfers, 2 * cross * p.micro_batches)
    busy = ((it.grad_sync_s if syncs else 0.0) + p2p) / it.iteration_time_s
    return min(busy, MAX_BUSY), transfers + (plan.num_layers if syncs else 0)


def busy_frac(plan: Plan, cm: HybridCostModel) -> float:
    return nic_traffic(plan, cm)[0]


def copy_wire_s(io: CheckpointIO, saved: Plan, k: int, num_nodes: int) -> float:
    """One peer copy's time on the wire alone: the busiest node's NICs."""
    fb = _file_bytes(io, saved)
    nodes = _rank_nodes(saved)
    sent: dict[int, float] = {}
    recv: dict[int, float] = {}
    files_in: dict[int, int] = {}
    for f, hs in place(io, saved, k, num_nodes, own=False).items():
        n = nodes[io.file_ranks(saved)[f]]
        for h in hs:
            sent[n] = sent.get(n, 0.0) + fb[f]
            recv[h] = recv.get(h, 0.0) + fb[f]
            files_in[h] = files_in.get(h, 0) + 1
    return max(max(sent.get(m, 0.0), recv.get(m, 0.0)) / NET.bandwidth_bytes_per_s + files_in.get(m, 0) * NET.latency_s
               for m in set(sent) | set(recv))


def peer_save(io: CheckpointIO, saved: Plan, cm: HybridCostModel, k: int, num_nodes: int, staging_s: float,
              step_s: float, mtbf_s: float) -> tuple[SaveCost, float, float]:
    """(the peer tier's save cost, copy wire time alone, busy fraction)."""
    wire = copy_wire_s(io, saved, k, num_nodes)
    f, transfers = nic_traffic(saved, cm)
    copy_s = wire / (1.0 - f)
    steps = math.ceil(copy_s / step_s)
    preempt = steps * transfers * IB_MTU_BYTES / cm.inter_bw_bytes_per_s
    stall = max(0.0, staging_s - step_s) + preempt
    lag = staging_s + copy_s
    return SaveCost(stall, lag, max(young_daly_s(stall, mtbf_s), lag, step_s)), wire, f


@dataclass(frozen=True)
class PeerLoad:
    t_s: float  # the load from holders (0 when it cannot run: some file has no live copy)
    lost_files: int  # needed files with no live copy
    peer_slices: int  # slices (splits) read from holders, every reader counted
    storage_slices: int  # slices that would come from storage (all of them when lost_files > 0)

    @property
    def from_peers(self) -> bool:
        return self.lost_files == 0


def load(io: CheckpointIO, saved: Plan, new: Plan, k: int, num_nodes: int, down_nodes: AbstractSet[int],
         copies_lost: bool = False) -> PeerLoad:
    """``copies_lost``: a correlated loss took every copy of each file that had a copy on a
    dead node (the dead node's failure domain held them all)."""
    pl = place(io, saved, k, num_nodes)
    served: dict[int, float] = {}
    lost: set = set()
    calls, rank_bytes, slices = 0, 0.0, 0
    for (per, n), (sl, _) in zip(io.load_ours_by_file(saved, new), io.slices_by_file(saved, new)):
        r_calls, r_bytes = 0, 0.0
        for f, (c, b) in per.items():
            slices += n * sl[f]
            gone = copies_lost and any(h in down_nodes for h in pl[f])
            alive = [h for h in pl[f] if h not in down_nodes] if not gone else []
            if not alive:
                lost.add(f)
                continue
            for h in alive:
                served[h] = served.get(h, 0.0) + n * b / len(alive)
            r_calls, r_bytes = r_calls + c, r_bytes + b
        calls, rank_bytes = max(calls, r_calls), max(rank_bytes, r_bytes)
    if lost:
        return PeerLoad(0.0, len(lost), 0, slices)
    per_node = max(_per_node_counts(new).values())
    t = (max(max(served.values()) / NET.bandwidth_bytes_per_s, per_node * rank_bytes / NET.bandwidth_bytes_per_s)
         + calls * NET.latency_s)
    return PeerLoad(t, 0, slices, 0)
