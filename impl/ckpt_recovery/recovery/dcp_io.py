"""torch DCP as the trainer's checkpoint backend: a rank's live state as DTensors of its
stage's TP sub-mesh (:mod:`impl.ckpt_recovery.dcp_baseline`), a checkpoint per step directory,
committed when DCP's ``.metadata`` is in place (DCP writes it last, after every rank)."""
from __future__ import annotations

import os
import re
from typing import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from impl.common.api import ConfigError
from impl.common.checkpoint.layout import Ownership, TensorMeta
from impl.common.storage.emulator import Storage

from .. import dcp_baseline as D

_STEP = re.compile(r"^step(\d{8})$")


def stage_mesh(stages, rank: int):
    """A DeviceMesh is rectangular: every stage must have the same TP degree (collective)."""
    sizes = {len(st.ranks) for st in stages}
    if len(sizes) != 1:
        raise ConfigError(f"dcp: a DeviceMesh is rectangular; stages of TP degrees {sorted(sizes)} do not form one")
    return D.stage_mesh([list(st.ranks) for st in stages], rank)


def save_sync(local: Mapping[str, torch.Tensor], metas: Sequence[TensorMeta], own: Ownership, mesh, path: str,
              storage: Storage) -> None:
    D.save_sync(D.to_dtensors(local, metas, own, mesh), path, storage)


def save_async(local, metas, own, mesh, path: str, storage: Storage, group, stager=None):
    return D.save_async(D.to_dtensors(local, metas, own, mesh), path, storage, group, stager=stager)


def process_stager():
    return D.process_stager()


def process_saver_pid():
    return D.process_saver_pid()


def latest_step(root: str) -> int:
    steps = [int(m.group(1)) for d in (os.listdir(root) if os.path.isdir(root) else ())
             if (m := _STEP.match(d)) and os.path.exists(os.path.join(root, d, ".metadata"))]
    if not steps:
        raise RuntimeError(f"{root}: no committed DCP checkpoint (no step dir with .metadata)")
    return max(steps)


def clear_uncommitted(root: str) -> None:
    """Rank 0 at a (re)start: step dirs of interrupted saves (no ``.metadata``) go, so no save
    writes into a directory holding another attempt's files."""
    import shutil

    for d in os.listdir(root) if os.path.isdir(root) else ():
        if _STEP.match(d) and not os.path.exists(os.path.join(root, d, ".metadata")):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def load_into(local: Mapping[str, torch.Tensor], metas, own: Ownership, mesh, path: str, storage: Storage) -> dict:
    """``dcp.load`` into DTensors shaped like ``local``, then copied into it in place."""
    dstate = D.empty_dtensors(metas, own, mesh, local)
    D.load(dstate, path, storage)
    with torch.no_grad():
        for k, v in dstate.items():
            local[k].copy_(v.to_local() if isinstance(v, DTensor) else v)
    needed = sum(t.numel() * t.element_size() for t in local.values())
    st = storage.stats
    return {"read_calls": st.read_calls, "bytes_read": st.read_bytes, "bytes_needed": needed,
            "read_amplification": st.read_bytes / needed if needed else 1.0}
