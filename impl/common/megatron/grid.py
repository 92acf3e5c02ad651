"""The Megatron baseline by the HotSPa authors' own grid rule (their Megatron-LM fork,
`Sakura-gh/Megatron-LM`, branch `long_seq`, `benchmark/generate_benchmark_scripts.py`), priced by the
Megatron-LM step model (:mod:`impl.common.megatron`): every (dp, tp, pp) with dp*tp*pp = N,
pp | L, tp | heads (tp across nodes allowed), every mbs in ``MBS`` with dp*mbs | gbs, packing as the
fork packs (a micro-batch's mbs sequences concatenated into one row; the LM head on the
mbs x context grid), sequence parallelism on, the distributed optimizer, no recompute. Layouts the
calibrated memory model says do not fit are dropped; the search over them (the fastest mean step on
the planning batches) is the shared baseline :mod:`impl.common.baselines.megatron_grid`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from impl.common.api import ConfigError
from .model import MegatronLayout, MegatronModel
from .step import pack_work, price

MBS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class GridLayout:
    dp: int
    tp: int
    pp: int
    mbs: int

    def __str__(self) -> str:
        return f"({self.dp},{self.tp},{self.pp}) mbs {self.mbs}"


def candidates(num_gpus: int, gpus_per_node: int, num_layers: int, heads: int, gbs: int) -> list[GridLayout]:
    out = []
    for tp in range(1, num_gpus + 1):
        if num_gpus % tp or heads % tp:
            continue
        if tp > gpus_per_node and tp % gpus_per_node:
            continue
        if tp <= gpus_per_node and gpus_per_node % tp:
            continue
        for pp in range(1, num_gpus // tp + 1):
            if (num_gpus // tp) % pp or num_layers % pp:
                continue
            dp = num_gpus // (tp * pp)
            out.extend(GridLayout(dp, tp, pp, m) for m in MBS if gbs % (dp * m) == 0)
    return out


def _docs(batches: Sequence) -> np.ndarray:
    """(steps, 1, gbs) sequence lengths: each planning step is one stream of one iteration."""
    n = {len(b.lengths) for b in batches}
    if len(n) != 1:
        raise ConfigError("system.policy megatron_grid: every step must hold the same number of sequences "
                          f"(got {sorted(n)}); the fork's global batch is a sequence count")
    return np.stack([np.asarray(b.lengths, dtype=float) for b in batches])[:, None, :]


def layout_of(g: GridLayout, gbs: int, context: int, gpus_per_node: int) -> MegatronLayout:
    return MegatronLayout(dp=g.dp, tp=g.tp, pp=g.pp, mbs=g.mbs, gbs=gbs, context=context, mode="pack",
                          sequence_parallel=True, gpus_per_node=gpus_per_node)


def step_prices(model: MegatronModel, g: GridLayout, batches: Sequence, context: int, hw, gpus_per_node: int):
    """Mean step time (s) over ``batches`` and whether the layout fits, with the step model."""
    docs = _docs(batches)
    lay = layout_of(g, docs.shape[2], context, gpus_per_node)
    est = price(model, lay, hw, pack_work(lay, docs))
    return est


def model_of(wl, stack: Optional[str] = None) -> MegatronModel:
    """The workload's model as Megatron builds it, running ``stack`` (a name of
    :data:`impl.common.megatron.stack.STACKS`; None: the model's ``megatron_stack``, else the
    fork's stack of the architecture): a system's simulator may price its baseline as the paper
    ran it and itself as its authors' code runs it."""
    return MegatronModel.from_shape(wl.model, context=wl.context, stack=stack)
