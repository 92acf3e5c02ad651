"""Megatron-style tensor parallelism of the varlen decoder, and TP shards of a state dict.

Split (:data:`impl.common.models.varlen_gpt.TP_PLAN`): q/k/v/gate/up column-parallel (output
features, so each rank holds ``heads / tp`` attention heads and ``ffn / tp`` FFN columns),
o/down row-parallel (input features). The embedding, the RMSNorms and the LM head stay whole
on every TP rank: their inputs are replicated after each row-parallel all-reduce, so every
TP rank computes the same values and the same gradients for them, with no collective.
Communication: the ``f`` operator (identity forward, all-reduce of the input gradient
backward) on the input of the attention and of the MLP sub-block, the ``g`` operator
(all-reduce forward, identity backward) on the outputs of o and down: 2 all-reduces forward
and 2 backward per layer.

Why an explicit split rather than ``torch.distributed.tensor.parallel``: ``parallelize_module``
with ``ColwiseParallel``/``RowwiseParallel`` over a 1-D CPU ``DeviceMesh`` does run forward and
backward on gloo (row-parallel output to ``Replicate`` is an all_reduce, never the
reduce_scatter gloo lacks), but each column-parallel module redistributes its own input
gradient, so one backward runs 5 all-reduces per layer (q, k, v, gate, up; counted with the
profiler: 28 for 4 layers) instead of Megatron's 2: the plan API cannot express "one ``f`` per
sub-block". HotSPa also rebinds a rank's shards into the compute model at every switch, which
on DTensor parameters goes through ``to_local`` views; with plain parameters a shard is just
a tensor. So the plan stays data (:data:`TP_PLAN`, :func:`shard_dim`) and the two operators
are the custom autograd functions below.

State-dict shards follow :mod:`impl.common.parallel.migration`'s fraction convention: TP rank t
of g holds the fraction ``[t/g, (t+1)/g)`` of every tensor of a unit, cut along the tensor's
:func:`shard_dim` (0 for column-parallel and for the replicated tensors, whose *state* shard
is a ZeRO-style row block; 1 for row-parallel). :func:`cut_state_dict` and
:func:`join_state_dicts` are inverse, bitwise.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from impl.common.api import ConfigError
from impl.common.models.varlen_gpt import TP_PLAN, VarlenGPT

_DIM = {"colwise": 0, "rowwise": 1}


def tp_split(name: str) -> Optional[str]:
    """``"colwise"`` / ``"rowwise"`` for a split weight of the varlen decoder, None if whole."""
    parts = name.split(".")
    if len(parts) == 5 and parts[0] == "blocks" and parts[-1] == "weight":
        return TP_PLAN.get(".".join(parts[2:4]))
    return None


def compute_dim(name: str) -> Optional[int]:
    """The dim a TP rank's compute copy is cut along; None = the whole tensor on every rank."""
    split = tp_split(name)
    return _DIM[split] if split else None


def shard_dim(name: str) -> int:
    """The dim a TP rank's *state* shard (fraction ``[t/g, (t+1)/g)``) is cut along."""
    d = compute_dim(name)
    return 0 if d is None else d


def fraction_slice(tensor: torch.Tensor, dim: int, lo: Fraction, hi: Fraction,
                   held: tuple[Fraction, Fraction] = (Fraction(0), Fraction(1)), full: Optional[int] = None) -> torch.Tensor:
    """The view of fraction ``[lo, hi)`` of a tensor of ``full`` rows along ``dim``, of which
    ``tensor`` holds the fraction ``held`` (default: all of it)."""
    n = tensor.shape[dim] if full is None else full
    a, b = lo * n, hi * n
    start = held[0] * n
    if a.denominator != 1 or b.denominator != 1 or start.denominator != 1:
        raise ValueError(f"fraction [{lo}, {hi}) of {n} rows is not a whole number of rows")
    return tensor.narrow(dim, int(a - start), int(b - a))


def check_tp_shape(shape, tp: int, field: str = "strategy") -> None:
    """Heads and FFN columns must split evenly over ``tp`` ranks (and so every state shard)."""
    for what, n in (("model.heads", shape.heads), ("model.ffn_hidden", shape.ffn_hidden or shape.ffn_mult * shape.hidden),
                    ("model.hidden", shape.hidden), ("model.vocab", shape.vocab)):
        if n % tp:
            raise ConfigError(f"{field}: tp={tp} does not divide {what} {n}")


def cut_state_dict(full: Mapping[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """TP rank ``rank`` of ``size``: fraction ``[rank/size, (rank+1)/size)`` of every tensor."""
    lo, hi = Fraction(rank, size), Fraction(rank + 1, size)
    return {k: fraction_slice(v, shard_dim(k), lo, hi).clone() for k, v in full.items()}


def join_state_dicts(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`cut_state_dict` over ranks ``0..size-1``."""
    return {k: torch.cat([s[k] for s in shards], dim=shard_dim(k)) for k in shards[0]}


def compute_shards(full: Mapping[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """A TP rank's compute copies: split weights cut, whole tensors kept whole."""
    lo, hi = Fraction(rank, size), Fraction(rank + 1, size)
    return {k: (v.clone() if compute_dim(k) is None else fraction_slice(v, compute_dim(k), lo, hi).clone())
            for k, v in full.items()}


class _CopyToTP(torch.autograd.Function):
    """Megatron ``f``: identity forward; all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron ``g``: all-reduce forward (partial row-parallel outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def tensor_parallel(model: VarlenGPT, rank: int, size: int, group=None) -> VarlenGPT:
    """Turn ``model`` (whole weights) into TP rank ``rank`` of ``size`` in place: split weights
    replaced by their shard, ``f``/``g`` installed as hooks. Returns the model."""
    check_tp_shape(model.shape, size)
    lo, hi = Fraction(rank, size), Fraction(rank + 1, size)
    with torch.no_grad():
        for name, p in list(model.named_parameters()):
            d = compute_dim(name)
            if d is None:
                continue
            mod = model.get_submodule(name.rsplit(".", 1)[0])
            mod.weight = nn.Parameter(fraction_slice(p.detach(), d, lo, hi).clone())
            if d == 0:
                mod.out_features //= size
            else:
                mod.in_features //= size
    if size == 1:
        return model

    def enter(_mod, args):
        return (_CopyToTP.apply(args[0], group), *args[1:])

    def leave(_mod, _args, out):
        return _ReduceFromTP.apply(out, group)

    for blk in model.blocks:
        blk.attn.register_forward_pre_hook(enter)
        blk.mlp.register_forward_pre_hook(enter)
        blk.attn.o.register_forward_hook(leave)
        blk.mlp.down.register_forward_hook(leave)
    model.tp_rank, model.tp_size = rank, size  # type: ignore[attr-defined]
    return model
