"""The per-node holder process of the peer-memory tier (``ckpt_recovery_peer``, real mode).

Emulated nodes share one host here, so a node's memory is a directory tree in shared memory
(``/dev/shm``) owned by one *holder process* per node:

    base/stage<node>/step<s>/rank<r>.safetensors   what the node's savers staged (their bytes,
                                                   written next to the storage write)
    base/holder<node>/...                          the node's holder: a CheckpointStore (peer.py)

A holder watches the storage tier's pointer. When a step is committed there, it copies every
file :func:`~impl.common.checkpoint.peer.holders` places on its node out of the owner node's
staging (its own node's: a local memory copy; another node's: a transfer over the emulated
network, priced by ``net``) and commits that step with :func:`~impl.common.checkpoint.peer.copy_commit`
(temp dir, manifest, rename, pointer; the previous commit stays readable until then). Until a
holder commits, a loss finds the previous commit there, or the storage tier (the window).

Which node owns a file comes from the commit itself (``extra["node_of_rank"]``): the layout,
and so the rank -> node map, changes after every recovery. A node's staging dir is trimmed by
its own holder to the steps other holders may still copy (the two newest committed).

A node lost with its GPU loses its memory: the supervisor SIGKILLs the node's holder and
removes its two trees (:func:`drop_node`), as the node's RAM would be gone; ``/dev/shm`` files
outlive their process, so that removal is what the emulation needs.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass
from typing import Mapping

from impl.common.storage.emulator import Storage, StorageProfile

from .fileformat import CheckpointError
from .peer import copy_commit, holder_root, holders
from .store import CheckpointStore, step_name


def stage_root(base: str, node: int) -> str:
    return os.path.join(base, f"stage{node:03d}")


def stage_file(base: str, node: int, step: int, fname: str, data: bytes | memoryview) -> None:
    """A saver's staged copy of its rank file (tmp + rename: a holder never sees half a file)."""
    d = os.path.join(stage_root(base, node), step_name(step))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{fname}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(d, fname))


@dataclass(frozen=True)
class HolderSpec:
    base: str  # shared-memory root of the tier
    node: int
    storage_root: str  # the storage tier's checkpoint root (its pointer is watched)
    copies: int  # k peers per file
    num_nodes: int
    net: StorageProfile  # a transfer from another node's staging
    min_step: int = 0  # a holder started after a recovery copies only steps after the resume point
    poll_s: float = 0.01


class _Staged(Mapping):
    """file -> its bytes from the owner node's staging (read when copy_commit asks for it)."""

    def __init__(self, spec: HolderSpec, step: int, owner: Mapping[str, int], net: Storage, local: Storage) -> None:
        self.spec, self.step, self.owner, self.net, self.local = spec, step, owner, net, local

    def __getitem__(self, fname: str) -> bytes:
        n = self.owner[fname]
        p = os.path.join(stage_root(self.spec.base, n), step_name(self.step), fname)
        if not os.path.exists(p):
            raise CheckpointError(f"{p}: not staged (its node's memory is gone or it was trimmed)")
        return (self.local if n == self.spec.node else self.net).read_file(p)

    def __iter__(self):
        return iter(self.owner)

    def __len__(self) -> int:
        return len(self.owner)


def copy_step(spec: HolderSpec, step: int, net: Storage, local: Storage) -> bool:
    """Copy committed storage step ``step``'s files placed on this node and commit them here.
    False (nothing committed) when a file it needs is no longer staged anywhere."""
    ck = CheckpointStore(spec.storage_root).open(step)
    files = ck.manifest["files"]
    node_of = ck.extra["node_of_rank"]
    owner = {f: int(node_of[rec["rank"]]) for f, rec in files.items()}
    where = holders(owner, spec.copies, spec.num_nodes, {f: rec["size"] for f, rec in files.items()})
    mine = {f: ((spec.node,) if spec.node in hs else ()) for f, hs in where.items()}
    if not any(mine.values()):
        return True
    try:
        copy_commit(spec.base, ck, _Staged(spec, step, owner, net, local), mine)
    except (CheckpointError, FileNotFoundError):
        return False
    return True


def _trim_stage(spec: HolderSpec, keep_from: int) -> None:
    root = stage_root(spec.base, spec.node)
    for d in os.listdir(root) if os.path.isdir(root) else ():
        if d.startswith("step") and d[4:].isdigit() and int(d[4:]) < keep_from:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def holder_main(spec: HolderSpec) -> None:
    """The holder process: copy each newly committed storage step until SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    net, local = Storage(spec.net), Storage()
    os.makedirs(holder_root(spec.base, spec.node), exist_ok=True)
    os.makedirs(stage_root(spec.base, spec.node), exist_ok=True)
    store = CheckpointStore(spec.storage_root)
    done, seen = spec.min_step - 1, []
    while True:
        try:
            s = store.latest()
            if s is not None and s > done and s >= spec.min_step:
                done = s
                seen = (seen + [s])[-2:]
                copy_step(spec, s, net, local)
                _trim_stage(spec, seen[0])
        except CheckpointError:
            pass  # rotated away before it could be opened: the next pointer wins
        time.sleep(spec.poll_s)


def drop_node(base: str, node: int) -> None:
    """The node's memory is gone: its holder's commits and its savers' staging."""
    for root in (holder_root(base, node), stage_root(base, node)):
        shutil.rmtree(root, ignore_errors=True)
