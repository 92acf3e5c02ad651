"""Megatron-style TP of the varlen decoder: losses and gradients equal the unsharded model, and
the state-dict shards follow plan_migration's fraction convention."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from impl.common.models.varlen_gpt import VarlenGPT, micro_batch_tensors
from impl.common.parallel.tensor_parallel import (compute_dim, compute_shards, cut_state_dict, fraction_slice,
                                                  join_state_dicts, shard_dim, tensor_parallel)
from impl.common.runtime.launch import launch
from impl.common.varlen.packing import hotspa_pack
from impl.common.workloads.pipeline import ModelShape

SHAPE = ModelShape(name="tp-test", num_layers=2, hidden=32, heads=4, ffn_hidden=48, vocab=64, seq_len=256)
SEED = 5


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _micro_batch():
    # one packed row of 4 documents with alignment padding at the end
    return hotspa_pack([0, 1, 2, 3], [70, 9, 33, 21], bound=256, pad="align", align=16)[0]


def _tp_rank(ctx):
    torch.set_num_threads(1)
    mb = _micro_batch()
    tok, tgt, cu, sl = micro_batch_tensors(mb, SHAPE.vocab, SEED)
    model = tensor_parallel(VarlenGPT(SHAPE, SEED), ctx.rank, ctx.world_size)
    loss = model(tok, tgt, cu, sl, global_tokens=500)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.real
def test_tp2_losses_and_gradients_equal_the_unsharded_model():
    out = launch(_tp_rank, 2, label="tp test", timeout_s=120).results
    ref = VarlenGPT(SHAPE, SEED)
    tok, tgt, cu, sl = micro_batch_tensors(_micro_batch(), SHAPE.vocab, SEED)
    loss = ref(tok, tgt, cu, sl, global_tokens=500)
    loss.backward()
    loss = loss.detach()
    for r in out:
        assert abs(float(r["loss"]) - float(loss)) / float(loss) < 1e-5
    split = 0
    for n, p in ref.named_parameters():
        d = compute_dim(n)
        if d is None:  # whole on every TP rank: the same gradient on each
            for r in out:
                assert max_rel(r["grads"][n], p.grad) < 1e-5, n
        else:
            split += 1
            got = torch.cat([r["grads"][n] for r in out], dim=d)
            assert got.shape == p.grad.shape and max_rel(got, p.grad) < 1e-5, n
    assert split == 7 * SHAPE.num_layers  # q k v o gate up down per block


def test_cut_and_join_are_inverse_and_follow_the_fraction_convention():
    full = {n: p.detach() for n, p in VarlenGPT(SHAPE, SEED).named_parameters()}
    shards = [cut_state_dict(full, t, 2) for t in range(2)]
    back = join_state_dicts(shards)
    for n, v in full.items():
        assert torch.equal(back[n], v), n
        d = shard_dim(n)
        for t in range(2):  # shard t = fraction [t/2, (t+1)/2) along the shard dim
            assert torch.equal(shards[t][n], fraction_slice(v, d, Fraction(t, 2), Fraction(t + 1, 2)))
    assert shard_dim("blocks.0.attn.o.weight") == 1 and shard_dim("blocks.0.mlp.up.weight") == 0
    comp = compute_shards(full, 1, 2)
    assert torch.equal(comp["head.weight"], full["head.weight"])  # whole on a TP rank
    assert comp["blocks.1.attn.q.weight"].shape == (16, 32) and comp["blocks.1.mlp.down.weight"].shape == (32, 24)
