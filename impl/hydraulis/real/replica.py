"""Replica kinds on CPU ranks (the CPU experiment, README "Real mode"): one compute module per (kind, rank), refilled
from the step's full weights, running its micro-batches with the kind's cap enforced.

A kind's cap is its memory limit: a micro-batch above it raises :class:`CapExceeded` (one
line, the numbers), it is never clipped or split. The module keeps its own parameters (the
compute copy); gradients accumulate over the replica's micro-batches and are read out whole
(tp 1) or as TP shards (a ``tp`` kind: :func:`~impl.common.parallel.tensor_parallel.tensor_parallel`
over the given process group).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from impl.common.api import ConfigError
from impl.common.models.varlen_gpt import VarlenGPT, micro_batch_tensors
from impl.common.parallel.tensor_parallel import tensor_parallel
from impl.common.varlen.packing import MicroBatch

from impl.hydraulis.real.config import ReplicaKind


class CapExceeded(ConfigError):
    """A micro-batch holds more tokens than its replica's cap (its memory limit)."""


def check_cap(kind: ReplicaKind, mbs: Sequence[MicroBatch], where: str) -> None:
    for j, mb in enumerate(mbs):
        if mb.num_tokens > kind.cap:
            raise CapExceeded(f"{where}: micro-batch {j} holds {mb.num_tokens} tokens > replica kind {kind.name!r} "
                              f"cap {kind.cap} (a memory limit: never clipped)")


@dataclass
class ReplicaRun:
    loss: float  # sum of the micro-batches' losses (each already / global tokens)
    mb_times_s: list  # (tokens, sum s^2, seconds) per micro-batch, in run order
    compute_s: float


class ReplicaModel:
    """The compute module of one kind on one rank."""

    def __init__(self, shape, seed: int, kind: ReplicaKind, tp_rank: int = 0, group=None, device="cpu") -> None:
        self.kind, self.shape, self.seed = kind, shape, seed
        with torch.device(device):  # built on the rank's device
            self.model = VarlenGPT(shape, seed, checkpoint=kind.checkpoint)
        self.device = torch.device(device)
        if kind.tp > 1:
            tensor_parallel(self.model, tp_rank, kind.tp, group)
        self.named = dict(self.model.named_parameters())

    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.named.items():
                if tuple(weights[n].shape) != tuple(p.shape):
                    raise ValueError(f"{n}: compute copy {tuple(weights[n].shape)} for a {tuple(p.shape)} parameter "
                                     f"(kind {self.kind.name}, tp {self.kind.tp})")
                p.copy_(weights[n])
                p.grad = None

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named.items()}

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.named.items()}

    def run(self, mbs: Sequence[MicroBatch], global_tokens: int, where: str,
            tensors: Optional[Sequence[tuple]] = None) -> ReplicaRun:
        """Forward + backward of every micro-batch (gradients accumulate). ``tensors``:
        prebuilt :func:`micro_batch_tensors` per micro-batch (data loading, outside the timing)."""
        check_cap(self.kind, mbs, where)
        if tensors is None:
            tensors = [micro_batch_tensors(mb, self.shape.vocab, self.seed) for mb in mbs]
        loss, times = 0.0, []
        t_all = time.perf_counter()
        for mb, mbt in zip(mbs, tensors):
            tok, tgt, cu, sl = (t.to(self.device, non_blocking=True) for t in mbt)
            t0 = time.perf_counter()
            out = self.model(tok, tgt, cu, sl, global_tokens=global_tokens)
            out.backward()
            loss += float(out.detach())  # reads the loss: the micro-batch's kernels are done on the clock below
            times.append((mb.num_tokens, sum(x * x for x in mb.lengths), time.perf_counter() - t0))
        return ReplicaRun(loss, times, time.perf_counter() - t_all)
