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


def record_reference_checks(res, checks: list, engine_loss, rtol: float) -> None:
    """Put the worst gradient / parameter / loss error of ``checks`` (dicts with ``grad_err``,
    ``param_err``, ``ref_loss``) into ``res``'s metrics and mark it invalid above ``rtol``;
    ``engine_loss(check)`` is the engine's loss for that check's step."""
    from impl.common.api import Metric

    if not checks:
        return
    ge, pe = max(c["grad_err"] for c in checks), max(c["param_err"] for c in checks)
    le = max(abs(engine_loss(c) - c["ref_loss"]) / abs(c["ref_loss"]) for c in checks)
    for name, v in (("grad_max_rel_err", ge), ("param_max_rel_err", pe), ("loss_max_rel_err", le)):
        res.metrics[name] = Metric.scalar(v, "fraction", "lower")
    for what, v in (("gradients", ge), ("parameters after Adam", pe), ("losses", le)):
        if not v <= rtol:
            res.mark_invalid(f"{what} differ from the single-process reference: max rel err {v:.2e} > {rtol}")
