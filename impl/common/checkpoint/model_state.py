"""A model's and its Adam optimizer's state as one flat dict of named tensors.

Names: ``param/<fqn>``, ``exp_avg/<fqn>``, ``exp_avg_sq/<fqn>``, ``step/<fqn>`` (Adam's step
is a float32 scalar per parameter, replicated). The shard dim of a parameter follows the
varlen decoder's Megatron plan (:data:`impl.common.models.varlen_gpt.TP_PLAN`): column-
parallel weights on dim 0 (output features), row-parallel ones on dim 1 (input features),
everything else replicated; Adam moments share their parameter's dim.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch import nn

from impl.common.models.varlen_gpt import TP_PLAN

from .layout import TensorMeta, dtype_name

MOMENTS = ("exp_avg", "exp_avg_sq")
_DIM = {"colwise": 0, "rowwise": 1}


def varlen_shard_dim(fqn: str) -> Optional[int]:
    parts = fqn.split(".")
    if len(parts) == 5 and parts[0] == "blocks" and parts[-1] == "weight":
        split = TP_PLAN.get(".".join(parts[2:4]))
        return _DIM[split] if split else None
    return None


def flat_state(model: nn.Module, opt: Optional[torch.optim.Optimizer] = None) -> dict[str, torch.Tensor]:
    """Views of the live tensors (copy them for a snapshot), in model order, each parameter's
    moments and step right after it (so a layer range is a contiguous run of keys)."""
    out = {}
    for k, p in model.named_parameters():
        out[f"param/{k}"] = p.detach()
        st = opt.state.get(p, {}) if opt is not None else {}
        for m in MOMENTS:
            if m in st:
                out[f"{m}/{k}"] = st[m]
        if "step" in st:
            out[f"step/{k}"] = st["step"]
    return out


def state_metas(state: Mapping[str, torch.Tensor], shard_dim: Callable[[str], Optional[int]] = varlen_shard_dim,
                full_shapes: Optional[Mapping[str, tuple]] = None) -> list[TensorMeta]:
    """Metas in state order; ``full_shapes`` gives whole shapes when ``state`` is a shard."""
    out = []
    for k, v in state.items():
        kind, fqn = k.split("/", 1)
        dim = None if kind == "step" else shard_dim(fqn)
        shape = tuple(full_shapes[k]) if full_shapes else tuple(v.shape)
        out.append(TensorMeta(k, shape, dtype_name(v.dtype), dim))
    return out
