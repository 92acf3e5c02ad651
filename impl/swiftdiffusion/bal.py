"""Bounded asynchronous LoRA loading (BAL, as in the authors' code, `modelscope/Katz`).

Loader processes (one per LoRA slot) wait on a shared-memory flag; on a request they read their
LoRA file through the storage emulator into preallocated fp16 shared-memory buffers and set the
flag to done. Denoising starts without the LoRA; before step i the base worker patches once
``all_done() or i >= K`` holds (waiting for the loads if needed), so the patch step is
``min(first step at which every load is done, K)``; K = 0 is the synchronous merge. After the
request the pristine weights are copied back.
"""
from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from impl.common.api import ConfigError

from impl.swiftdiffusion.lora import LoadedLoRA, TargetTable, merge, restore
from impl.common.execution import set_torch_threads

IDLE, REQUESTED, DONE, FAILED = 0, 1, 2, 3


def check_k(k: int, num_steps: Optional[int] = None) -> None:
    if k < 0:
        raise ConfigError(f"system.k (patch step bound K) must be >= 0, got {k}")
    if num_steps is not None and k >= num_steps:
        raise ConfigError(f"system.k (patch step bound K) must be < workload.num_steps = {num_steps}, got {k}")


def header(path) -> tuple[dict, dict]:
    """A safetensors file's tensor table and metadata, without reading the tensors."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    meta = h.pop("__metadata__", {}) or {}
    return h, meta


def file_rank(path) -> tuple[float, int]:
    _, meta = header(path)
    m = json.loads(meta.get("lora_adapter_metadata", "{}"))
    if "unet.r" not in m:
        raise ConfigError(f"lora file {path}: no lora_adapter_metadata with unet.r / unet.lora_alpha")
    return float(m["unet.lora_alpha"]), int(m["unet.r"])


def check_file(table: TargetTable, path, name: str, max_rank: int) -> list[str]:
    """Admission check from the header alone (keys, ranks, shapes), before any load."""
    h, _ = header(path)
    alpha, r = file_rank(path)
    if r > max_rank:
        raise ConfigError(f"lora {name}: rank {r} exceeds the loader buffers' max rank {max_rank}")
    fake = {k: torch.empty(v["shape"], device="meta") for k, v in h.items()}
    return table.check(fake, r, f"lora {name}")


@dataclass
class SharedSlots:
    """Preallocated shared-memory LoRA buffers, one set per loader slot, at the max rank."""

    # [slots, 4] int64: flag, rank, file index, stop. Stop has its own column so that a loader
    # finishing a load (flag := DONE) can never overwrite the base's request to stop.
    ctl: torch.Tensor
    scale: torch.Tensor  # [slots] float64
    present: torch.Tensor  # [slots, sites] int8: the file patches this site
    A: list  # per slot: list over sites of [r_max, d_in] fp16
    B: list  # per slot: list over sites of [d_out, r_max] fp16
    site_names: list
    max_rank: int

    @classmethod
    def allocate(cls, table: TargetTable, slots: int, max_rank: int, dtype=torch.float16) -> "SharedSlots":
        names = sorted(table.sites)
        A = [[torch.zeros(max_rank, table.sites[n].weight.shape[1], dtype=dtype).share_memory_() for n in names]
             for _ in range(slots)]
        B = [[torch.zeros(table.sites[n].weight.shape[0], max_rank, dtype=dtype).share_memory_() for n in names]
             for _ in range(slots)]
        return cls(torch.zeros(slots, 4, dtype=torch.int64).share_memory_(),
                   torch.zeros(slots, dtype=torch.float64).share_memory_(),
                   torch.zeros(slots, len(names), dtype=torch.int8).share_memory_(), A, B, names, max_rank)

    def view(self, slot: int, table: TargetTable, name: str) -> LoadedLoRA:
        r = int(self.ctl[slot, 1])
        state, sites = {}, []
        for j, n in enumerate(self.site_names):
            if self.present[slot, j]:
                s = table.sites[n]
                # Contiguous copies: the same B@A kernels as a synchronous merge of the file.
                state[s.a_key] = self.A[slot][j][:r].contiguous()
                state[s.b_key] = self.B[slot][j][:, :r].contiguous()
                sites.append(n)
        return LoadedLoRA(name, state, float(self.scale[slot]), sites)


def loader_loop(slot: int, slots: SharedSlots, paths: Sequence[str], storage, emulated_bytes: Optional[float],
                poll_s: float = 0.0005) -> int:
    """A loader process's life: wait for REQUESTED, load, set DONE; until the stop column is set. Returns loads done."""
    from safetensors.torch import load as st_load

    set_torch_threads(1)
    index = {n: j for j, n in enumerate(slots.site_names)}
    loads = 0
    while True:
        flag = int(slots.ctl[slot, 0])
        if int(slots.ctl[slot, 3]):
            return loads
        if flag != REQUESTED:
            time.sleep(poll_s)
            continue
        path = paths[int(slots.ctl[slot, 2])]
        try:
            data = storage.read_file(path, emulated_bytes)
            alpha, r = file_rank(path)
            state = st_load(data)
            slots.present[slot].zero_()
            for k, v in state.items():
                mod, ab = k[len("unet."):].rsplit(".lora_", 1)
                j = index[mod]
                if ab.startswith("A"):
                    slots.A[slot][j][:r].copy_(v)
                else:
                    slots.B[slot][j][:, :r].copy_(v)
                slots.present[slot, j] = 1
            slots.ctl[slot, 1] = r
            slots.scale[slot] = alpha / r
            slots.ctl[slot, 0] = DONE  # last: the base worker reads the buffers after this
        except Exception:
            slots.ctl[slot, 0] = FAILED
            raise
        loads += 1


@dataclass
class PatchPolicy:
    """The patch decision of one request: at the first step i with ``all_done() or i >= K``."""

    k: int
    all_done: Callable[[], bool]
    wait_all: Callable[[], None]
    apply: Callable[[], set]
    patched_at: Optional[int] = None
    touched: set = field(default_factory=set)
    waited_s: float = 0.0
    first_all_done: Optional[int] = None  # the first step at which the check saw every load done

    def before_step(self, i: int) -> None:
        if self.patched_at is not None:
            return
        done = self.all_done()
        if done and self.first_all_done is None:
            self.first_all_done = i
        if done or i >= self.k:
            t0 = time.perf_counter()
            self.wait_all()
            self.waited_s = time.perf_counter() - t0
            self.touched = self.apply()
            self.patched_at = i


def expected_patch_step(first_all_done: Optional[int], k: int) -> int:
    """min(first step with all loaded, K)."""
    return k if first_all_done is None else min(first_all_done, k)


class LoaderClient:
    """The base worker's side of the loaders: signal, poll, wait, view."""

    def __init__(self, slots: SharedSlots, table: TargetTable, paths: Sequence[str], max_rank: int):
        self.slots, self.table, self.paths = slots, table, list(paths)
        self.max_rank = max_rank
        self.active: list[tuple[int, str]] = []

    def signal(self, file_indices: Sequence[int]) -> None:
        if len(file_indices) > self.slots.ctl.shape[0]:
            raise ConfigError(f"workload.lora_ranks: {len(file_indices)} LoRAs for {self.slots.ctl.shape[0]} loader slots")
        self.active = []
        for slot, fi in enumerate(file_indices):
            check_file(self.table, self.paths[fi], f"#{fi}", self.max_rank)
            self.slots.ctl[slot, 2] = fi
            self.slots.ctl[slot, 0] = REQUESTED
            self.active.append((slot, f"lora-{fi}"))

    def _flags(self):
        return [int(self.slots.ctl[s, 0]) for s, _ in self.active]

    def all_done(self) -> bool:
        f = self._flags()
        if FAILED in f:
            raise RuntimeError("a LoRA loader failed (see its traceback)")
        return all(x == DONE for x in f)

    def wait_all(self, poll_s: float = 0.0005) -> None:
        while not self.all_done():
            time.sleep(poll_s)

    def take(self) -> list[LoadedLoRA]:
        out = [self.slots.view(s, self.table, n) for s, n in self.active]
        for s, _ in self.active:
            self.slots.ctl[s, 0] = IDLE
        return out

    def stop(self) -> None:
        self.slots.ctl[:, 3] = 1


def bal_request(client: LoaderClient, file_indices: Sequence[int], k: int, run: Callable) -> tuple:
    """One request under BAL: signal loaders, denoise with the patch hook, restore.

    ``run(before_step)`` runs the denoising loop; returns (latents, PatchPolicy)."""
    check_k(k)
    table = client.table
    if not file_indices:
        return run(None), None
    client.signal(file_indices)
    pol = PatchPolicy(k, client.all_done, client.wait_all, lambda: merge(table, client.take()))
    try:
        z = run(pol.before_step)
    finally:
        if pol.patched_at is None:  # a loop shorter than K: patch never happened; drain the loaders
            client.wait_all()
            client.take()
        restore(table, pol.touched)
    return z, pol
