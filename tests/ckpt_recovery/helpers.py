"""A tiny varlen decoder with one Adam step taken, its flat state and layouts (shared by tests)."""
from __future__ import annotations

import functools

from impl.ckpt_recovery.bench import full_state
from impl.common.checkpoint.layout import StagePlan, pipeline_layout
from impl.common.workloads.pipeline import ModelShape

SHAPE = ModelShape(name="ckpt-test", num_layers=4, hidden=64, heads=4, ffn_hidden=128, vocab=256, seq_len=32)


def trained_state(seed: int = 0, steps: int = 1):
    state, metas = _trained(seed, steps)
    return {k: v.clone() for k, v in state.items()}, metas


@functools.lru_cache(maxsize=8)
def _trained(seed: int, steps: int):
    return full_state(SHAPE, seed, steps, tokens=16)


def tp2pp2(metas):
    """4 ranks: stage 0 = ranks 0,1 (layers 0-2), stage 1 = ranks 2,3 (layers 2-4)."""
    return pipeline_layout(metas, [[StagePlan((0, 1), (0, 2)), StagePlan((2, 3), (2, 4))]], SHAPE.num_layers)


def tp2_tp1(metas, split=3):
    """3 survivors: [TP2 | TP1]."""
    return pipeline_layout(metas, [[StagePlan((0, 1), (0, split)), StagePlan((2,), (split, 4))]], SHAPE.num_layers)


def tp1(metas):
    return pipeline_layout(metas, [[StagePlan((0,), (0, 4))]], SHAPE.num_layers)


def tp2(metas):
    return pipeline_layout(metas, [[StagePlan((0, 1), (0, 4))]], SHAPE.num_layers)
