"""What a training rank needs from its device, the same calls on the CPU (gloo) and a GPU (NCCL).

The launcher gives each rank its device (``RankContext.device``: ``cuda:<local rank>`` under
NCCL, the CPU under gloo); the job's execution decision gives the compute dtype. Rank code
places its modules with :func:`place`, times with :class:`Intervals` (CUDA events on a GPU, so
the timed step has no host sync of its own; the clock on the CPU) and reports
:func:`peak_memory_bytes` (``torch.cuda.max_memory_allocated``; None on the CPU, where torch
keeps no allocator statistics).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def place(module: nn.Module, device: torch.device, dtype_name: str = "fp32") -> nn.Module:
    """``module`` on the rank's device in the job's compute dtype (built on the CPU from a seeded
    generator first, so every device starts from the same weights)."""
    return module.to(device=device, dtype=DTYPES[dtype_name])


class Intervals:
    """Spans on one device, read after the timed region: CUDA events on a GPU (recorded on the
    current stream, resolved by one synchronize in :meth:`seconds`), ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: list = []

    def begin(self) -> int:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._spans.append([ev, None])
        else:
            self._spans.append([time.perf_counter(), None])
        return len(self._spans) - 1

    def end(self, i: int) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._spans[i][1] = ev
        else:
            self._spans[i][1] = time.perf_counter()

    def seconds(self) -> list[float]:
        """Every span in order; clears them."""
        if self.cuda:
            torch.cuda.synchronize()
            out = [a.elapsed_time(b) / 1e3 for a, b in self._spans]
        else:
            out = [b - a for a, b in self._spans]
        self._spans = []
        return out


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
