"""Synchronous save of one step: the commit protocol of :mod:`.store` driven by a process group
(every rank calls :func:`save`) or, for tests and single-process tools, by one process playing
every rank in turn (:func:`save_serial`). Non-tensor state (``consumed_samples``, RNG state,
LR-scheduler state) goes into the manifest's ``extra`` as JSON: RNG bytes as hex."""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from .layout import CheckpointLayout, TensorMeta, check_layout
from .plan import model_order, save_items
from .store import CheckpointStore


def rng_to_json(state: torch.Tensor) -> dict:
    return {"dtype": "uint8", "hex": state.numpy().tobytes().hex()}


def rng_from_json(d: Mapping) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes.fromhex(d["hex"])), dtype=torch.uint8).clone()


def save_serial(store: CheckpointStore, step: int, metas: Sequence[TensorMeta], layout: CheckpointLayout, S: int,
                locals_by_rank: Mapping[int, Mapping[str, torch.Tensor]], extra: dict,
                duplicate: bool = False) -> str:
    check_layout(metas, layout, S)
    store.begin(step)
    order = model_order(metas)
    recs = [store.write_rank(step, r, save_items(metas, layout, S, r, locals_by_rank[r], duplicate), order)
            for r in sorted(layout.ranks)]
    return store.commit(step, recs, metas, layout, S, extra)


def save(store: CheckpointStore, rank: int, world: int, step: int, metas: Sequence[TensorMeta], layout: CheckpointLayout,
         S: int, local: Mapping[str, torch.Tensor], extra: dict, barrier: Callable[[], None],
         duplicate: bool = False) -> Optional[str]:
    """Every rank of the group calls this; rank 0 commits (returns the dir there)."""
    if rank == 0:
        check_layout(metas, layout, S)
        store.begin(step)
    barrier()
    store.write_rank(step, rank, save_items(metas, layout, S, rank, local, duplicate), model_order(metas))
    barrier()
    out = None
    if rank == 0:
        out = store.commit(step, store.read_sidecars(step, world), metas, layout, S, extra)
    barrier()
    return out
