"""Real save and resharded-load runs of scenario A (impl/ckpt_recovery/README.md,
"Reconstructed choices"), one function per
phase, run on every rank by :func:`impl.common.runtime.launch.launch`.

Every rank builds the same seeded model and takes the same Adam steps on the full model, then
keeps only its shard under the layout (the full-state stand-in until real TP training is
merged: the checkpoint path sees exactly the per-rank state a TP x PP run would hold).
Between saves a rank runs ``compute_s`` of matmuls (a synthetic training step; records say so).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from impl.common.checkpoint.async_save import AsyncCheckpointer
from impl.common.checkpoint.layout import CheckpointLayout, StagePlan, cut_state, pipeline_layout
from impl.common.checkpoint.model_state import flat_state, state_metas
from impl.common.checkpoint.reshard import load_rank
from impl.common.checkpoint.save import rng_to_json, save
from impl.common.checkpoint.store import CheckpointStore
from impl.common.models.varlen_gpt import VarlenGPT
from impl.common.storage.emulator import Storage, StorageProfile
from impl.common.workloads.pipeline import ModelShape
from impl.common.execution import set_torch_threads


@dataclass
class BenchSpec:
    shape: ModelShape
    seed: int
    root: str
    splits: int = 32
    prof: StorageProfile = field(default_factory=StorageProfile)
    saves: int = 3
    compute_s: float = 0.2
    min_interval_s: float = 0.0
    systems: tuple = ("elastor", "dcp_sync", "dcp_async")
    old: tuple = ()  # pipelines of StagePlan
    new: tuple = ()
    dcp_grid_old: tuple = ((0, 1), (2, 3))  # (pp, tp) rank grid
    dcp_grid_new: tuple = ((0, 1),)


def full_state(shape: ModelShape, seed: int, steps: int = 1, tokens: int = 64):
    """Model + Adam state after ``steps`` seeded steps on one ``tokens``-long sequence, flat."""
    torch.manual_seed(seed)
    model = VarlenGPT(shape, seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tok = torch.randint(0, shape.vocab, (tokens,), generator=g)
        loss = model(tok, tok.roll(-1), torch.tensor([0, tokens], dtype=torch.int32))
        opt.zero_grad()
        loss.backward()
        opt.step()
    st = {k: v.detach().clone() for k, v in flat_state(model, opt).items()}
    return st, state_metas(st)


def _compute(seconds: float) -> None:
    a = torch.randn(128, 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _layout(metas, pipelines, L) -> CheckpointLayout:
    return pipeline_layout(metas, [list(p) for p in pipelines], L)


def save_phase(ctx, spec: BenchSpec) -> dict:
    """Old layout: each system saves ``saves`` times between synthetic steps; per-save stall."""
    set_torch_threads(1)
    state, metas = full_state(spec.shape, spec.seed)
    lay = _layout(metas, spec.old, spec.shape.num_layers)
    own = lay.ranks[ctx.rank]
    local = cut_state(state, metas, own)
    out: dict = {}
    extra = {"consumed_samples": 0, "rng": rng_to_json(torch.get_rng_state()), "scheduler": {"last_epoch": 1}}
    barrier = lambda: dist.barrier()  # noqa: E731
    for system in spec.systems:
        root = os.path.join(spec.root, system)
        storage = Storage(spec.prof)
        stalls, commits = [], []
        dist.barrier()
        if system == "elastor_sync":
            store = CheckpointStore(root, storage)
            for i in range(spec.saves):
                _compute(spec.compute_s)
                t0 = time.perf_counter()
                save(store, ctx.rank, ctx.world_size, i + 1, metas, lay, spec.splits, local, extra, barrier)
                stalls.append(time.perf_counter() - t0)
        elif system == "elastor":
            ck = AsyncCheckpointer(root, ctx.rank, ctx.world_size, metas, lay, spec.splits, local, prof=spec.prof,
                                   min_interval_s=spec.min_interval_s)
            for i in range(spec.saves * 3):
                _compute(spec.compute_s)
                ck.step(i + 1, local, extra)
            log = ck.finish()
            stalls = list(ck.log.stall_s)
            out[f"{system}_log"] = log
        elif system in ("dcp_sync", "dcp_async"):
            from impl.ckpt_recovery import dcp_baseline as D

            mesh = D.stage_mesh(spec.dcp_grid_old, ctx.rank)
            dstate = D.to_dtensors(local, metas, own, mesh)
            group = dist.new_group(backend="gloo") if system == "dcp_async" else None
            fut = None
            for i in range(spec.saves):
                _compute(spec.compute_s)
                t0 = time.perf_counter()
                if fut is not None:
                    fut.result()  # one save in flight: waiting for the previous one is stall
                path = os.path.join(root, f"step{i + 1:08d}")
                if system == "dcp_sync":
                    D.save_sync(dstate, path, storage)
                else:
                    fut = D.save_async(dstate, path, storage, group)
                stalls.append(time.perf_counter() - t0)
            if fut is not None:
                fut.result()
            dist.barrier()
        out[system] = {"stall_s": stalls, "io": storage.stats.to_dict()}
    return out


def load_phase(ctx, spec: BenchSpec, system: str, step: Optional[int] = None) -> dict:
    """New layout: load ``system``'s last checkpoint with resharding; checks bit-exactness."""
    set_torch_threads(1)
    state, metas = full_state(spec.shape, spec.seed)
    storage = Storage(spec.prof)
    dist.barrier()
    t0 = time.perf_counter()
    if system.startswith("elastor"):
        lay = _layout(metas, spec.new, spec.shape.num_layers)
        store = CheckpointStore(os.path.join(spec.root, system), storage)
        ck = store.open(step)
        local, st = load_rank(ck, lay, ctx.rank, storage, metas=metas)
        own = lay.ranks[ctx.rank]
        info = st.to_dict()
    else:
        from torch.distributed.tensor import DTensor

        from impl.ckpt_recovery import dcp_baseline as D

        grid = spec.dcp_grid_new
        stages = [StagePlan(tuple(row), (0, spec.shape.num_layers)) for row in grid]
        lay = _layout(metas, [stages[:1]] if len(grid) == 1 else [stages], spec.shape.num_layers)
        own = lay.ranks[ctx.rank]
        mesh = D.stage_mesh(grid, ctx.rank)
        target = cut_state(state, metas, own)
        dstate = D.empty_dtensors(metas, own, mesh, target)
        root = os.path.join(spec.root, system)
        last = sorted(d for d in os.listdir(root) if d.startswith("step"))[-1]
        D.load(dstate, os.path.join(root, last), storage)
        local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in dstate.items()}
        needed = sum(t.numel() * t.element_size() for t in local.values())
        info = {"read_calls": storage.stats.read_calls, "bytes_read": storage.stats.read_bytes,
                "bytes_needed": needed, "read_amplification": storage.stats.read_bytes / needed}
    t_load = time.perf_counter() - t0
    expect = cut_state(state, metas, own)
    exact = all(local[k].dtype == expect[k].dtype and torch.equal(local[k], expect[k]) for k in expect)
    return {**info, "t_load_s": t_load, "bit_exact": exact, "tensors": len(expect)}
