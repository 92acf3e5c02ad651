"""The authors' code's local-copy option in the sim: every rank file also copied to the local NVMe
of ``k`` other nodes after each commit (``sim.local_copies``; ours only).

Placement: the file written on node n goes to nodes n+1 .. n+k (mod the node count).
Copy (after the commit, in the background): the writer's saver sends the bytes it still holds
in host memory; per node, max(bytes sent / network, bytes received / NVMe write) + one NVMe
request per received file, the slowest node bounding it (``PAPER_PROFILES`` network 400 GB/s
and nvme 4 GB/s per node; one write per copy, not the nvme profile's buddy pair).
Load: a needed file with a surviving copy is read from a holder's NVMe (its reads split evenly
over its surviving holders; a holder serves every reader at 4 GB/s in all) and sent over the
network to the reader (a reader on the holder's node pays the same NVMe read; the network leg,
< 1 s here, is not waived for it); a file whose every copy sat on a dead node comes from the
shared storage, and so does the manifest. Both sources run at once: T = max(copies, storage).
The loader takes the faster of that and reading everything from storage (both priced by the
same model before the first read).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet

from impl.common.parallel.plan import Plan
from impl.common.storage.emulator import PAPER_PROFILES, StorageProfile

from impl.ckpt_recovery.sim.cost import _per_node_counts, _rank_nodes, read_time_s
from impl.ckpt_recovery.sim.checkpoint_io import CheckpointIO, LoadIO, RankIO

NVME = PAPER_PROFILES["nvme"]
NET = PAPER_PROFILES["network"]


def holders(node: int, k: int, num_nodes: int) -> tuple[int, ...]:
    return tuple((node + j) % num_nodes for j in range(1, k + 1))


def placement(io: CheckpointIO, saved: Plan, k: int, num_nodes: int) -> dict[str, tuple[int, ...]]:
    """file -> the nodes holding its local copies."""
    nodes = _rank_nodes(saved)
    return {f: holders(nodes[r], k, num_nodes) for f, r in io.file_ranks(saved).items()}


def copy_time_s(io: CheckpointIO, saved: Plan, k: int, num_nodes: int) -> float:
    """Commit -> every file's k copies written."""
    nodes = _rank_nodes(saved)
    sent: dict[int, float] = {}
    recv: dict[int, float] = {}
    files_in: dict[int, int] = {}
    for r, b in io.save_ours(saved).rank_bytes.items():
        n = nodes[r]
        for h in holders(n, k, num_nodes):
            sent[n] = sent.get(n, 0.0) + b
            recv[h] = recv.get(h, 0.0) + b
            files_in[h] = files_in.get(h, 0) + 1
    return max(max(sent.get(m, 0.0) / NET.bandwidth_bytes_per_s, recv.get(m, 0.0) / NVME.bandwidth_bytes_per_s)
               + files_in.get(m, 0) * NVME.latency_s for m in set(sent) | set(recv))


@dataclass(frozen=True)
class LocalLoad:
    t_s: float
    from_copies: bool  # False: every byte from storage was the faster choice
    storage_bytes: float  # bytes the load reads from the shared storage
    copy_bytes: float  # bytes it reads from local copies
    storage_only_bytes: float  # bytes of the files that lost every copy (what must come from storage)


def load(io: CheckpointIO, prof: StorageProfile, saved: Plan, new: Plan, k: int, num_nodes: int,
         down_nodes: AbstractSet[int]) -> LocalLoad:
    place = placement(io, saved, k, num_nodes)
    served: dict[int, float] = {}
    storage_readers, local_calls, local_rank_bytes, lost_bytes, copy_bytes = [], 0, 0.0, 0.0, 0.0
    for per, n in io.load_ours_by_file(saved, new):
        s_calls, s_bytes, l_calls, l_bytes = 1, 0.0, 0, 0.0  # the manifest always from storage
        for f, (c, b) in per.items():
            alive = [h for h in place[f] if h not in down_nodes]
            if alive:
                for h in alive:
                    served[h] = served.get(h, 0.0) + n * b / len(alive)
                l_calls, l_bytes = l_calls + c, l_bytes + b
            else:
                s_calls, s_bytes = s_calls + c, s_bytes + b
        storage_readers.append((RankIO(s_calls, s_bytes, s_bytes), n))
        local_calls, local_rank_bytes = max(local_calls, l_calls), max(local_rank_bytes, l_bytes)
        lost_bytes += n * s_bytes
        copy_bytes += n * l_bytes
    storage_io = LoadIO(tuple(storage_readers))
    t_storage = read_time_s(prof, storage_io, new)
    t_local = 0.0
    if served:
        per_node = max(_per_node_counts(new).values())
        t_local = (max(max(served.values()) / NVME.bandwidth_bytes_per_s,
                       per_node * local_rank_bytes / NET.bandwidth_bytes_per_s)
                   + local_calls * (NVME.latency_s + NET.latency_s))
    t_mixed = max(t_local, t_storage)
    full = io.load_ours(saved, new)
    t_all = read_time_s(prof, full, new)
    if t_all < t_mixed:
        return LocalLoad(t_all, False, full.total_bytes(), 0.0, lost_bytes)
    return LocalLoad(t_mixed, True, lost_bytes, copy_bytes, lost_bytes)

