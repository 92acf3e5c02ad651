"""Per-step activation cache of an original generation (as in the executor of the authors' Hetu
engine, branch `diffusers` of `Hankpipi/Hetu`).

Entries are keyed by ``(step, op name)``. Record mode writes step ``i`` only between
``begin_step(i)`` and ``end_step(i)``; edit mode reads step ``i`` only while the edit is at
step ``i`` (the engine passes its own step counter), so an entry can never be used at another
step. Tensors live in host memory (a device tensor is copied with a non-blocking D2H) unless
``store_device`` names a device (the fast engine's ``system.cache_device``: the cache stays
resident on the job's GPU, no copy per op per step).

:meth:`consolidate` (the fast engine, once per edit) stacks each op's entries into one tensor
``[steps, ...]`` on a device and leaves the per-step entries as views of it, so a step can be
selected on the device by a step index (``stacks[name]``, row ``rows[step]``) and a captured
CUDA graph can read any step; the bytes are the same, so ``nbytes`` does not change.

A byte budget bounds the cache: a step that does not fit is dropped whole and recorded in
``skipped_steps``; the edit runs such a step dense (a miss).
"""
from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from impl.common.api import ConfigError


class CacheMiss(KeyError):
    pass


@dataclass
class ActivationCache:
    meta: dict = field(default_factory=dict)
    budget_bytes: float = math.inf
    entries: dict = field(default_factory=dict)  # step -> {name: tensor}
    skipped_steps: list = field(default_factory=list)
    store_device: Optional[str] = None  # None / "cpu": host memory; else keep entries on that device
    _open: Optional[int] = None
    _dropping: bool = False
    _d2h: bool = False
    nbytes: int = 0
    stacks: dict = field(default_factory=dict)  # name -> [rows, ...] (after consolidate)
    rows: dict = field(default_factory=dict)  # step -> row of the stacks

    # ---- record ----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        if self._open is not None:
            raise RuntimeError(f"cache: step {self._open} still open when step {step} began")
        if step in self.entries:
            raise RuntimeError(f"cache: step {step} recorded twice")
        self._open, self._dropping = step, False
        self.entries[step] = {}

    def put(self, step: int, name: str, tensor: torch.Tensor, copy: bool = False) -> None:
        """Store ``tensor`` for (step, name); ``copy``: the tensor is a buffer its owner reuses."""
        if step != self._open:
            raise RuntimeError(f"cache: write for step {step} while step {self._open} is open (misaligned)")
        if self._dropping:
            return
        slot = self.entries[step]
        if name in slot:
            raise RuntimeError(f"cache: {name} written twice at step {step} (a module ran twice per step?)")
        t = tensor.detach()
        keep = self.store_device not in (None, "cpu") and t.device == torch.device(self.store_device)
        if t.device.type != "cpu" and not keep:
            t = t.to("cpu", non_blocking=True)
            self._d2h = True
        elif copy:
            t = t.clone()
        size = t.numel() * t.element_size()
        if self.nbytes + size > self.budget_bytes:
            self._drop_open()
            return
        slot[name] = t
        self.nbytes += size

    def _drop_open(self) -> None:
        step = self._open
        self.nbytes -= sum(t.numel() * t.element_size() for t in self.entries[step].values())
        self.entries.pop(step)
        self.skipped_steps.append(step)
        self._dropping = True

    def end_step(self, step: int) -> None:
        if step != self._open:
            raise RuntimeError(f"cache: end of step {step} while step {self._open} is open")
        if self._d2h and torch.cuda.is_available():
            torch.cuda.synchronize()  # the D2H copies above are non-blocking
        self._open, self._dropping, self._d2h = None, False, False

    # ---- read ------------------------------------------------------------------------------
    def has_step(self, step: int) -> bool:
        return step in self.entries

    def get(self, step: int, name: str, device=None) -> torch.Tensor:
        try:
            t = self.entries[step][name]
        except KeyError:
            raise CacheMiss(f"cache has no entry {name!r} at step {step}") from None
        return t if device is None or t.device == torch.device(device) else t.to(device, non_blocking=True)

    def consolidate(self, device) -> None:
        """Stack each op's entries on ``device`` (rows = recorded steps in order); the per-step
        entries become views of the stacks. Idempotent for the same device."""
        device = torch.device(device)
        steps = sorted(self.entries)
        if self.stacks and all(t.device == device for t in self.stacks.values()) and list(self.rows) == steps:
            return
        self.rows = {s: j for j, s in enumerate(steps)}
        names = list(self.entries[steps[0]]) if steps else []
        self.stacks = {}
        for name in names:
            st = torch.stack([self.entries[s][name].to(device) for s in steps])
            self.stacks[name] = st
            for j, s in enumerate(steps):
                self.entries[s][name] = st[j]
        if device.type != "cpu":
            self.store_device = str(device)

    def step_bytes(self, step: int) -> int:
        return sum(t.numel() * t.element_size() for t in self.entries.get(step, {}).values())

    def check_compatible(self, *, seed: int, scheduler: str, timesteps: list, latent_shape: tuple) -> None:
        """One line per mismatch kind: the same z_T and scheduler are mandatory."""
        m = self.meta
        if m.get("seed") != seed:
            raise ConfigError(f"workload.edit_seed: the cache was recorded with seed {m.get('seed')} but the edit uses "
                              f"seed {seed}; the same z_T is mandatory (a new seed is a new image, not an edit)")
        if m.get("scheduler") != scheduler:
            raise ConfigError(f"workload.edit_scheduler: the cache was recorded with scheduler {m.get('scheduler')} "
                              f"but the edit uses {scheduler}; the same scheduler config is mandatory")
        if list(m.get("timesteps", [])) != list(timesteps):
            raise ConfigError(f"workload.num_steps: the cache holds {len(m.get('timesteps', []))} steps but the edit "
                              f"runs {len(timesteps)} (timesteps differ)")
        if tuple(m.get("latent_shape", ())) != tuple(latent_shape):
            raise ConfigError(f"workload.unet.sample_size: the cache latent shape {tuple(m.get('latent_shape', ()))} "
                              f"differs from the edit's {tuple(latent_shape)}")

    # ---- offload round trip ---------------------------------------------------------------
    def save(self, path) -> pathlib.Path:
        path = pathlib.Path(path)
        entries = {s: {k: v.clone() if self.stacks else v for k, v in d.items()} for s, d in self.entries.items()}
        torch.save({"meta": self.meta, "entries": entries, "skipped_steps": self.skipped_steps,
                    "budget_bytes": self.budget_bytes}, path)
        return path

    @classmethod
    def load(cls, path) -> "ActivationCache":
        # weights_only: a cache file may come from anyone; it must never run pickled code.
        data: dict[str, Any] = torch.load(pathlib.Path(path), weights_only=True)
        c = cls(meta=data["meta"], budget_bytes=data["budget_bytes"], entries=data["entries"],
                skipped_steps=list(data["skipped_steps"]))
        c.nbytes = sum(c.step_bytes(s) for s in c.entries)
        return c
