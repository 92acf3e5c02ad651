"""Tiny GPT: the split model equals the single-process model exactly."""
from __future__ import annotations

import pytest
import torch

from impl.common.api import ConfigError
from impl.common.models.tiny_gpt import (build_full_model, build_stage, make_microbatches,
                                         reference_step, reference_train, stage_layer_ranges)
from impl.common.runtime.stage import StageRunner
from impl.common.workloads.pipeline import ModelShape

torch.set_num_threads(1)
SHAPE = ModelShape(num_layers=6, hidden=32, heads=4, ffn_mult=2, vocab=64, seq_len=16)


def test_layer_ranges_cover_all_blocks():
    assert [list(r) for r in stage_layer_ranges(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ConfigError, match="model.num_layers: 2 layers cannot be split over 3 stages"):
        build_stage(ModelShape(num_layers=2), 0, 3, seed=0)


def test_stage_params_are_the_full_models():
    full = dict(build_full_model(SHAPE, seed=3).named_parameters())
    seen = {}
    for s in range(3):
        for name, p in build_stage(SHAPE, s, 3, seed=3).named_parameters():
            assert name not in seen
            seen[name] = p
    assert sorted(seen) == sorted(full)
    for name in full:
        assert torch.equal(seen[name], full[name]), name


def _pipelined(num_stages, batches, order):
    """Drive StageRunners in one process; ``order`` is 'gpipe' (all F, all B, all W) or
    'interleaved' (per micro-batch F then B of the next ... in reverse mb order for W)."""
    n = len(batches)
    runners = [StageRunner(build_stage(SHAPE, s, num_stages, seed=7), n) for s in range(num_stages)]
    acts = {}
    for j, (tok, tgt) in enumerate(batches):
        x = tok
        for s, r in enumerate(runners):
            x = r.forward(j, x, tgt if s == num_stages - 1 else None)
        acts[j] = x
    mbs = list(range(n)) if order == "gpipe" else list(reversed(range(n)))
    for j in mbs:  # B in any order: accumulation is still micro-batch ordered
        g = None
        for r in reversed(runners):
            g = r.backward_input(j, g)
    for j in mbs:
        for r in runners:
            r.backward_weight(j)
    losses = runners[-1].finish_iteration()
    for r in runners[:-1]:
        r.finish_iteration()
    grads = {n_: p.grad for r in runners for n_, p in r.stage.named_parameters()}
    return losses, grads


@pytest.mark.parametrize("num_stages,order", [(2, "gpipe"), (3, "interleaved")])
def test_split_equals_single_process_bitwise(num_stages, order):
    batches = make_microbatches(SHAPE, 2, 4, seed=1, iteration=0)
    ref = reference_step(SHAPE, batches, seed=7)
    losses, grads = _pipelined(num_stages, batches, order)
    assert losses == ref.losses
    assert sorted(grads) == sorted(ref.grads)
    for name, g in ref.grads.items():
        assert torch.equal(grads[name], g), name


def test_reference_train_is_deterministic_and_updates():
    a = reference_train(SHAPE, 2, 4, iterations=2, seed=0, optimizer="adam", lr=1e-2)
    b = reference_train(SHAPE, 2, 4, iterations=2, seed=0, optimizer="adam", lr=1e-2)
    assert a.losses == b.losses
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    init = dict(build_full_model(SHAPE, seed=0).named_parameters())
    assert not torch.equal(a.params["blocks.0.attn.qkv.weight"], init["blocks.0.attn.qkv.weight"])
