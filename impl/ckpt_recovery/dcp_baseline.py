"""torch DCP baselines (our choice [R]: impl/ckpt_recovery/README.md, "Reconstructed choices"):
the same per-rank state as DTensors on the stage's TP sub-mesh, saved with ``dcp.save`` / ``dcp.async_save`` and loaded with ``dcp.load`` into the
best homogeneous layout (a DeviceMesh is rectangular), all through the emulated store of
:mod:`impl.common.storage.dcp_fs`."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from impl.common.checkpoint.layout import Ownership, TensorMeta
from impl.common.storage.dcp_fs import EmulatedFileSystemReader, EmulatedFileSystemWriter
from impl.common.storage.emulator import Storage


def stage_mesh(grid: Sequence[Sequence[int]], rank: int) -> DeviceMesh:
    """The TP sub-mesh of ``rank`` in a rectangular (pp, tp) grid of ranks (collective)."""
    mesh = DeviceMesh("cpu", torch.tensor(grid), mesh_dim_names=("pp", "tp"))
    return mesh["tp"]


def to_dtensors(local: Mapping[str, torch.Tensor], metas: Sequence[TensorMeta], own: Ownership,
                mesh: DeviceMesh) -> dict:
    by = {m.name: m for m in metas}
    out = {}
    for k, v in local.items():
        m = by[k]
        if m.dim is None:
            # Replicated: a plain tensor (DCP saves one copy, every rank reads it); a 0-dim
            # replicated DTensor breaks async_save's staging copy in torch 2.13.
            out[k] = v
            continue
        out[k] = DTensor.from_local(v, mesh, [Shard(m.dim)], run_check=False, shape=torch.Size(m.shape),
                                    stride=torch.empty(m.shape, device="meta").stride())
    return out


def empty_dtensors(metas: Sequence[TensorMeta], own: Ownership, mesh: DeviceMesh, like: Mapping[str, torch.Tensor]) -> dict:
    return to_dtensors({k: torch.zeros_like(like[k]) for k in own}, metas, own, mesh)


def save_sync(state: dict, path: str, storage: Storage) -> None:
    dcp.save(state, storage_writer=EmulatedFileSystemWriter(path, storage))


def save_async(state: dict, path: str, storage: Storage, group, stager=None):
    """Returns the future; the caller waits on it before the next save (one in flight).

    ``stager`` None: DCP's default thread executor, staging a fresh CPU copy per save.
    A :func:`process_stager`: the DCP-async baseline's "process + pinned memory" variant, DCP's checkpoint
    daemon process writing from the stager's reused shared-memory buffers."""
    writer = EmulatedFileSystemWriter(path, storage)
    if stager is None:
        return dcp.async_save(state, storage_writer=writer, process_group=group)
    return dcp.async_save(state, storage_writer=writer, process_group=group,
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)


def process_saver_pid() -> Optional[int]:
    """The pid of DCP's checkpoint daemon in this process (None before the first process-mode
    save). torch keeps it in a private module global: read defensively, so a torch that moves
    it yields None (the supervisor then cannot kill it: see the test that checks it does)."""
    from torch.distributed.checkpoint import _async_process_executor as ape

    proc = getattr(getattr(ape, "_CHECKPOINT_PROCESS", None), "_save_process", None)
    return getattr(proc, "pid", None)


def process_stager() -> DefaultStager:
    """Synchronous staging (the stall is the copy, as for ours) into shared memory the daemon
    process reads; pinned only where CUDA exists (pinning needs a CUDA context)."""
    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
                                        use_async_staging=False, use_non_blocking_copy=False))


def load(state: dict, path: str, storage: Storage) -> None:
    dcp.load(state, storage_reader=EmulatedFileSystemReader(path, storage))
