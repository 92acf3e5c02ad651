"""The varlen decoder: packed == alone, global-token loss normalisation, checkpointing, padding."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from impl.common.api import ConfigError
from impl.common.models.varlen_gpt import (TP_PLAN, build_varlen_model, micro_batch_tensors, sequence_tokens,
                                           spec5_shape, step_target_tokens)
from impl.common.varlen import LengthDist, LengthStream, hotspa_pack, pad_to_max
from impl.common.workloads.pipeline import ModelShape

SMALL = ModelShape(name="varlen-test", num_layers=2, hidden=32, heads=4, ffn_hidden=48, vocab=97, seq_len=256)
SEED = 3


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    yield


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def assert_grads_close(a, b, tol):
    assert a.keys() == b.keys()
    worst = max((rel(a[n], b[n]), n) for n in a)
    assert worst[0] < tol, worst


def alone(model, sid, length, shape, global_tokens):
    seq = sequence_tokens(sid, length, shape.vocab, SEED)
    cu = torch.tensor([0, length], dtype=torch.int32)
    return seq, cu, model(seq[:-1], seq[1:], cu, global_tokens=global_tokens)


def _step(n=10, median=40.0):
    return LengthStream(LengthDist(median=median, sigma=0.6, min_len=2, max_len=120), SEED).by_count(n)


@pytest.mark.parametrize("shape,attention", [(SMALL, "segments"), (SMALL, "mask"), (spec5_shape(), "segments")])
def test_packed_equals_each_sequence_alone(shape, attention):
    model = build_varlen_model(shape, seed=1, attention=attention)
    step = _step(8 if shape is SMALL else 4)
    (mb,) = hotspa_pack(step.ids, step.lengths, 1024, pad="align", align=128)
    tokens, targets, cu, seqlens = micro_batch_tensors(mb, shape.vocab, SEED)
    assert mb.padded_len > mb.num_tokens  # alignment padding is present
    g_total = mb.num_tokens
    with torch.no_grad():
        packed_logits = model.logits(tokens, cu)
    model(tokens, targets, cu, global_tokens=g_total).backward()
    packed_grads = grads(model)
    for i, (sid, length) in enumerate(zip(mb.seq_ids, mb.lengths)):
        seq, one_cu, loss = alone(model, sid, length, shape, g_total)
        loss.backward()
        with torch.no_grad():
            own = model.logits(seq[:-1], one_cu)
        a = int(mb.cu_seqlens[i])
        assert rel(packed_logits[a:a + length], own) < 1e-5
    assert_grads_close(packed_grads, grads(model), 1e-5)


def test_micro_batch_grads_with_global_tokens_equal_the_whole_step():
    model = build_varlen_model(SMALL, seed=2)
    step = _step(24)
    whole = hotspa_pack(step.ids, step.lengths, 4096, pad="none")
    assert len(whole) == 1
    tok, tgt, cu, _ = micro_batch_tensors(whole[0], SMALL.vocab, SEED)
    model(tok, tgt, cu).backward()  # mean over the step's tokens, in one row
    ref = grads(model)
    # Two other packings of the same step: HotSPa micro-batches and pad-to-max rows.
    for mbs in (hotspa_pack(step.ids, step.lengths, 256, pad="align", align=64),
                pad_to_max(step.ids, step.lengths, micro_batch_size=5)):
        assert len(mbs) > 2
        g_total = step_target_tokens(mbs)
        assert g_total == step.num_tokens
        for mb in mbs:
            tok, tgt, cu, seqlens = micro_batch_tensors(mb, SMALL.vocab, SEED)
            model(tok, tgt, cu, seqlens, global_tokens=g_total).backward()
        assert_grads_close(grads(model), ref, 1e-5)
    # A per-micro-batch mean (the thing the substrate replaces) gives a different gradient.
    for mb in hotspa_pack(step.ids, step.lengths, 256, pad="none"):
        tok, tgt, cu, _ = micro_batch_tensors(mb, SMALL.vocab, SEED)
        model(tok, tgt, cu).backward()
    per_mb = grads(model)
    assert rel(per_mb["head.weight"], ref["head.weight"]) > 1e-3


def test_checkpointing_changes_nothing():
    step = _step(12)
    (mb,) = hotspa_pack(step.ids, step.lengths, 1024, pad="align", align=128)
    tok, tgt, cu, _ = micro_batch_tensors(mb, SMALL.vocab, SEED)
    out = {}
    for ckpt in (False, True):
        model = build_varlen_model(SMALL, seed=4, checkpoint=ckpt)
        loss = model(tok, tgt, cu, global_tokens=1000)
        loss.backward()
        out[ckpt] = (loss.item(), grads(model))
    assert abs(out[True][0] - out[False][0]) <= 1e-6 * abs(out[False][0])
    assert_grads_close(out[True][1], out[False][1], 1e-6)


def test_padding_contributes_nothing():
    model = build_varlen_model(SMALL, seed=5)
    step = _step(6)
    results = []
    for pad, align, pad_id in (("none", 1, 0), ("align", 128, 0), ("align", 128, 7), ("bound", 64, 11)):
        (mb,) = hotspa_pack(step.ids, step.lengths, 1024, pad=pad, align=align)
        tok, tgt, cu, _ = micro_batch_tensors(mb, SMALL.vocab, SEED, pad_id=pad_id)
        tgt[mb.num_tokens:] = torch.randint(0, SMALL.vocab, (mb.pad_tokens,))  # garbage targets on padding
        loss = model(tok, tgt, cu, global_tokens=500)
        loss.backward()
        results.append((mb.pad_tokens, loss.item(), grads(model)))
    assert [r[0] for r in results][0] == 0 and all(r[0] > 0 for r in results[1:])
    for _, loss, g in results[1:]:
        assert abs(loss - results[0][1]) <= 1e-6 * results[0][1]
        assert_grads_close(g, results[0][2], 1e-6)
    # Pad-token embeddings get no gradient from the padding itself: a pad id no real token uses.
    used = set()
    for sid, length in zip(step.ids, step.lengths):
        used |= set(sequence_tokens(int(sid), int(length), SMALL.vocab, SEED)[:-1].tolist())
    unused = next(t for t in range(SMALL.vocab) if t not in used)
    (mb,) = hotspa_pack(step.ids, step.lengths, 1024, pad="align", align=128)
    tok, tgt, cu, _ = micro_batch_tensors(mb, SMALL.vocab, SEED, pad_id=unused)
    model(tok, tgt, cu).backward()
    assert float(grads(model)["tok_emb.weight"][unused].abs().max()) == 0.0


def test_segments_never_attend_across_documents():
    model = build_varlen_model(SMALL, seed=6)
    a = sequence_tokens(1, 20, SMALL.vocab, SEED)[:-1]
    b1 = sequence_tokens(2, 15, SMALL.vocab, SEED)[:-1]
    b2 = sequence_tokens(3, 15, SMALL.vocab, SEED)[:-1]
    cu = torch.tensor([0, 15, 35], dtype=torch.int32)
    with torch.no_grad():
        x = model.logits(torch.cat([b1, a]), cu)
        y = model.logits(torch.cat([b2, a]), cu)
    assert rel(x[15:], y[15:]) < 1e-6 and rel(x[:15], y[:15]) > 1e-3


def test_tp_plan_names_separate_linears_and_bad_inputs():
    model = build_varlen_model(SMALL, seed=0)
    for blk in model.blocks:
        for name in TP_PLAN:
            assert isinstance(blk.get_submodule(name), nn.Linear)
    with pytest.raises(ConfigError, match="model.hidden: 30 is not divisible by model.heads 4"):
        build_varlen_model(ModelShape(hidden=30, heads=4, ffn_hidden=8), 0)
    with pytest.raises(ConfigError, match="model.attention: unknown 'flash'"):
        build_varlen_model(SMALL, 0, attention="flash")
    tok = torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(tok, tok, torch.tensor([0, 12], dtype=torch.int32))
    gelu = build_varlen_model(ModelShape(num_layers=1, hidden=16, heads=2, ffn_mult=2, ffn_hidden=0, vocab=20), 0)
    assert not hasattr(gelu.blocks[0].mlp, "gate")
    assert np.isfinite(gelu(tok, tok, torch.tensor([0, 4, 10], dtype=torch.int32)).item())
