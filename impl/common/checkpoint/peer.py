"""Partition-agnostic checkpoint files held in other hosts' memory (the peer-memory tier of ``ckpt_recovery_peer``).

After a commit, every rank file is also copied into the host memory of ``k`` other nodes
(its *peers*: never the owner's node, so a lost node never takes every fast copy of its own
shards) and kept in its own node's memory (the owner's holder: the nearest copy after a GPU
loss, and the surviving copy of the files a dead node held for others). A holder is a directory in shared memory (``/dev/shm`` on Linux: what a holder
process maps) run by the same commit protocol as the storage tier
(:class:`~impl.common.checkpoint.store.CheckpointStore`: temp dir, manifest, rename, pointer,
rotation keeping 2 commits = a double buffer), holding only the files placed on it. Its
manifest names the files it holds and, under ``extra["all_files"]``, every file of the commit,
so a loader can tell whether the live holders together cover a step.

A load (:func:`open_from_holders`) takes the newest step whose every file sits in some live
holder's committed dir, and reads with the storage path's own read plan
(:func:`impl.common.checkpoint.reshard.load_rank` with a per-file ``locate``): the nearest live
copy per file (a holder on the reader's node, then another node's holder), files with no live
copy from the storage tier when it holds the same step.

Kill points of a copy (:func:`copy_kill_points`): per (file, holder) before / mid / after the
copy, then per holder the store's own commit points, prefixed ``h<node>:``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from impl.common.api import ConfigError
from impl.common.storage.emulator import Storage

from .fileformat import CheckpointError
from .store import Checkpoint, CheckpointStore, step_name

COMMIT_POINTS = ("after_barrier", "after_manifest", "after_rename", "mid_pointer", "after_pointer_tmp",
                 "after_pointer", "mid_rotation", "after_rotation")


def holders(file_nodes: Mapping[str, int], k: int, num_nodes: int,
            sizes: Optional[Mapping[str, float]] = None) -> dict[str, tuple[int, ...]]:
    """file -> every node holding it: its owner's node first, then its ``k`` peers."""
    return {f: (file_nodes[f],) + hs for f, hs in placement(file_nodes, k, num_nodes, sizes).items()}


def placement(file_nodes: Mapping[str, int], k: int, num_nodes: int,
              sizes: Optional[Mapping[str, float]] = None) -> dict[str, tuple[int, ...]]:
    """file -> its ``k`` peer nodes: never the owner's node; largest file first onto the
    least-loaded other nodes (load = bytes held, each node's own files included), so the
    fullest node's host memory and the busiest holder's recovery traffic stay near the mean."""
    if k < 1:
        raise ConfigError(f"peer.copies: must be >= 1, got {k}")
    if k > num_nodes - 1:
        raise ConfigError(f"peer.copies: {k} copies off the owner's node need >= {k + 1} nodes, got {num_nodes}")
    size = {f: float(sizes[f]) if sizes is not None else 1.0 for f in file_nodes}
    load = [0.0] * num_nodes
    for f, n in file_nodes.items():
        load[n] += size[f]
    out = {}
    for f in sorted(file_nodes, key=lambda f: (-size[f], f)):
        n = file_nodes[f]
        pick = sorted((m for m in range(num_nodes) if m != n), key=lambda m: (load[m], m))[:k]
        for m in pick:
            load[m] += size[f]
        out[f] = tuple(pick)
    return out


@dataclass(frozen=True)
class HostMemory:
    """Peak host memory of one node with peer copies (bytes)."""

    node: int
    train_bytes: float  # the training processes' own host memory
    snapshot_bytes: float  # their pinned / shared-memory snapshot buffers
    held_bytes: float  # files this node holds, its own and other nodes' (one commit)
    versions: int  # commits held at once (the committed one + the one being copied in)

    @property
    def total(self) -> float:
        return self.train_bytes + self.snapshot_bytes + self.versions * self.held_bytes


def check_host_memory(per_node: Sequence[HostMemory], capacity_bytes: float, field: str) -> None:
    """One line naming ``field`` when the fullest node's copies do not fit beside training."""
    worst = max(per_node, key=lambda h: h.total)
    if worst.total > capacity_bytes:
        raise ConfigError(
            f"{field}: peer copies do not fit on node {worst.node}: training {worst.train_bytes / 1e9:.0f} GB + "
            f"snapshot {worst.snapshot_bytes / 1e9:.0f} GB + {worst.versions} x {worst.held_bytes / 1e9:.0f} GB held "
            f"= {worst.total / 1e9:.0f} GB > {capacity_bytes / 1e9:.0f} GB")


def holder_root(base: str, node: int) -> str:
    return os.path.join(base, f"holder{node:03d}")


def copy_kill_points(files: Sequence[str], where: Mapping[str, Sequence[int]]) -> list[str]:
    """Every point of one peer copy at which a crash is tested, in the order a copy passes them."""
    pts = []
    for f in sorted(files):
        for h in where[f]:
            pts += [f"before_copy:{f}@{h}", f"mid_copy:{f}@{h}", f"after_copy:{f}@{h}"]
    for h in sorted({h for hs in where.values() for h in hs}):
        pts += [f"h{h}:{p}" for p in COMMIT_POINTS]
    return pts


def copy_commit(base: str, ck: Checkpoint, data: Mapping[str, bytes | memoryview], where: Mapping[str, Sequence[int]],
                kill: Optional[Callable[[str], None]] = None, storage: Optional[Storage] = None) -> None:
    """Copy committed checkpoint ``ck``'s files (their bytes in ``data``, still in the saver's
    memory) to the holders ``where`` names (:func:`holders`) and commit each holder. A holder
    commits only when every file placed on it is in; until then its previous commit stays
    readable."""
    kill = kill or (lambda point: None)
    storage = storage or Storage()
    files = ck.manifest["files"]
    per_holder: dict[int, list[str]] = {}
    for f in sorted(files):
        for h in where[f]:
            per_holder.setdefault(h, []).append(f)
    stores = {h: CheckpointStore(holder_root(base, h), storage, keep=2,
                                 kill=(lambda p, h=h: kill(f"h{h}:{p}")))
              for h in per_holder}
    for h, st in list(stores.items()):
        pointed = st.latest() if os.path.exists(os.path.join(st.root, "step.txt")) else None
        if pointed is not None and pointed >= ck.step and ck.step in st.committed_steps():
            del stores[h]  # a re-copy after a crash: this holder committed the step already
            continue
        st.drop_unpointed()  # renamed by a copy that died before its pointer
        st.clear_stale()
        os.makedirs(st.tmp_dir(ck.step))
    for f in sorted(files):
        for h in (h for h in where[f] if h in stores):
            kill(f"before_copy:{f}@{h}")
            storage.write_file(os.path.join(stores[h].tmp_dir(ck.step), f), data[f],
                               midway=lambda f=f, h=h: kill(f"mid_copy:{f}@{h}"))
            kill(f"after_copy:{f}@{h}")
    for h, st in sorted(stores.items()):
        held = [files[f] for f in per_holder[h]]
        st.commit(ck.step, held, ck.metas, ck.layout, ck.splits, {**ck.extra, "all_files": files})


@dataclass
class PeerView:
    """A step readable from the live holders (plus storage for files no live holder has)."""

    checkpoint: Checkpoint  # the full manifest (every file); ``dir`` is not where files live
    where: dict  # file -> (path, source): source "peer:<node>" or "storage"

    def locate(self, fname: str) -> str:
        return self.where[fname][0]

    def sources(self) -> dict[str, str]:
        return {f: s for f, (_, s) in self.where.items()}

    def locator(self, peer: Storage, storage: Storage, local: Optional[Storage] = None,
                reader_node: Optional[int] = None) -> Callable[[str], tuple[str, Storage]]:
        """For :func:`~impl.common.checkpoint.reshard.load_rank`: holder files counted on
        ``peer``, storage files on ``storage``; with ``local``, files in the reader node's own
        holder on ``local`` (a memory read, not a transfer)."""
        def locate(f: str) -> tuple[str, Storage]:
            path, src = self.where[f]
            if src == "storage":
                return path, storage
            return path, local if local is not None and src == f"peer:{reader_node}" else peer
        return locate


def _holder_steps(base: str, node: int) -> dict[int, Checkpoint]:
    root = holder_root(base, node)
    if not os.path.isdir(root):
        return {}
    st = CheckpointStore(root)
    out = {}
    pointed = st.latest() if os.path.exists(os.path.join(root, "step.txt")) else None
    for s in st.committed_steps():
        if pointed is not None and s > pointed:
            continue  # renamed but never pointed: the commit died before its pointer
        try:
            out[s] = st.open(s)
        except CheckpointError:
            continue
    return out


def open_from_holders(base: str, live_nodes: Sequence[int], reader_node: Optional[int] = None,
                      storage_store: Optional[CheckpointStore] = None, min_step: int = -1) -> PeerView:
    """The newest step every file of which is in a live holder's committed dir (or, failing
    that for some files, on the storage tier at the same step)."""
    held: dict[int, dict[int, Checkpoint]] = {n: _holder_steps(base, n) for n in live_nodes}
    steps = sorted({s for per in held.values() for s in per}, reverse=True)
    storage_steps = set(storage_store.committed_steps()) if storage_store is not None else set()
    for s in steps:
        if s < min_step:
            break
        ref = next(per[s] for per in held.values() if s in per)
        all_files = ref.extra["all_files"]
        where = {}
        order = sorted(held, key=lambda n: (n != reader_node, n))  # the reader's own host first
        for f in all_files:
            for n in order:
                ck = held[n].get(s)
                if ck is not None and f in ck.manifest["files"]:
                    where[f] = (os.path.join(ck.dir, f), f"peer:{n}")
                    break
        missing = [f for f in all_files if f not in where]
        if missing and s in storage_steps:
            sck = storage_store.open(s)
            for f in missing:
                where[f] = (os.path.join(sck.dir, f), "storage")
            missing = []
        if missing:
            continue
        manifest = {**ref.manifest, "files": all_files,
                    "extra": {k: v for k, v in ref.extra.items() if k != "all_files"}}
        return PeerView(Checkpoint(ref.root, s, manifest), where)
    raise CheckpointError(f"{base}: no step readable from live holders {sorted(live_nodes)}"
                          + (" or storage" if storage_store is not None else ""))

