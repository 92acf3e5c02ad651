"""A single-process reference for real multi-rank training checks (HotSPa, Hydraulis).

The reference computes a step's gradient on the full model itself (compared with the engine's)
and then applies Adam to the *engine's* gradient, so the parameter check isolates the one
optimizer step from Adam's sensitivity to last-bit gradient differences where |g| ~ eps.
"""
from __future__ import annotations

from typing import Iterable

import torch

from impl.common.models.varlen_gpt import VarlenGPT, micro_batch_tensors
from impl.common.workloads.pipeline import ModelShape


def max_rel_err(got: dict, ref: dict) -> float:
    """Max over tensors of max|got - ref| / max|ref|."""
    out = 0.0
    for n, r in ref.items():
        scale = float(r.abs().max())
        out = max(out, float((got[n] - r).abs().max()) / (scale if scale > 0 else 1.0))
    return out


class AdamReference:
    """Full :class:`VarlenGPT` and Adam in one process (rank 0)."""

    def __init__(self, shape: ModelShape, seed: int, lr: float) -> None:
        self.model = VarlenGPT(shape, seed)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.vocab = shape.vocab

    def step(self, params: dict, micro_batches: Iterable, global_tokens: int, data_seed: int,
             engine_grads: dict) -> tuple[float, dict, dict]:
        """(loss, own gradients, parameters after Adam on ``engine_grads``) from ``params``."""
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(params[n])
        self.opt.zero_grad(set_to_none=True)
        loss = 0.0
        for mb in micro_batches:
            out = self.model(*micro_batch_tensors(mb, self.vocab, data_seed), global_tokens=global_tokens)
            out.backward()
            loss += float(out.detach())
        grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        for n, p in self.model.named_parameters():
            p.grad = engine_grads[n].clone()
        self.opt.step()
        return loss, grads, {n: p.detach().clone() for n, p in self.model.named_parameters()}
