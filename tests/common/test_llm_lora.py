"""Multi-LoRA invariants on a toy Llama with PEFT-created adapters."""
from __future__ import annotations

import copy

import pytest
import torch

from impl.common.api import ConfigError
from impl.common.llm import kernels as K
from impl.common.llm.forward import RequestSlice, KVCache, ragged_forward
from impl.common.llm.lora import (AdapterSpec, LoRABatch, adapters_from_peft, load_peft_model, make_peft_model,
                                  merge_adapter, save_adapters, unmerge_adapter)
from impl.common.llm.model import build_llama, build_tokenizer, encode_bytes
from impl.common.workloads.serving import LlamaShape

SHAPE = LlamaShape(hidden=64, ffn_hidden=128, num_layers=3, heads=4, kv_heads=2, vocab=300)
SPECS = [AdapterSpec("r8", 8), AdapterSpec("r16", 16), AdapterSpec("r32", 32), AdapterSpec("r64", 64)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup():
    base = build_llama(SHAPE, seed=0)
    pm = make_peft_model(copy.deepcopy(base), SPECS, seed=1)
    return base, pm, adapters_from_peft(pm)


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, 260, (n,), generator=g).tolist() for n in (7, 3, 11, 5, 9)]


def _batch(adapters, names, lens, kernel):
    used = sorted({n for n in names if n})
    slot = {n: i for i, n in enumerate(used)}
    rows, segs = [], []
    for n, ln in zip(names, lens):
        s = slot[n] if n else -1
        rows += [s] * ln
        segs.append((s, ln))
    return LoRABatch(adapters=[adapters[n] for n in used], row_adapter=torch.tensor(rows), segments=segs, kernel=kernel)


@pytest.mark.parametrize("kernel", ["sgmv", "bgmv", "mbgmv"])
def test_batched_equals_per_request_peft(setup, kernel):
    base, pm, adapters = setup
    prompts = _prompts()
    names = ["r8", "r64", None, "r16", "r32"]
    items = [RequestSlice(p, KVCache()) for p in prompts]
    out = ragged_forward(base, items, _batch(adapters, names, [len(p) for p in prompts], kernel), all_logits=True)
    start = 0
    for p, n in zip(prompts, names):
        ids = torch.tensor([p])
        if n is None:
            with pm.disable_adapter():
                ref = pm(input_ids=ids).logits[0]
        else:
            pm.set_adapter(n)
            ref = pm(input_ids=ids).logits[0]
        got = out[start:start + len(p)]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        start += len(p)


def test_peft_mixed_batch_adapter_names(setup):
    base, pm, adapters = setup
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(4, 260, (4, 6), generator=g)
    names = ["r16", "__base__", "r64", "r8"]
    ref = pm(input_ids=ids, adapter_names=names).logits
    items = [RequestSlice(ids[i].tolist(), KVCache()) for i in range(4)]
    batch = _batch(adapters, [None if n == "__base__" else n for n in names], [6] * 4, "bgmv")
    got = ragged_forward(base, items, batch, all_logits=True).view(4, 6, -1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_zero_padding_rank_is_bit_identical():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 64, generator=g)
    A, B = torch.randn(8, 64, generator=g), torch.randn(48, 8, generator=g)
    Ap, Bp = K.pad_rank(A, B, 64)
    assert torch.equal(K.lora_delta(x, A, B, 0.5), K.lora_delta(x, Ap, Bp, 0.5))
    # BGMV over a stack padded to the batch's max rank == each adapter at its own rank (MBGMV)
    A2, B2 = torch.randn(64, 64, generator=g), torch.randn(48, 64, generator=g)
    As, Bs = K.stack_padded([A, A2], [B, B2])
    idx = torch.tensor([0, 1, 0, -1, 1, 0, 0, 1, -1, 0, 1, 1, 0])
    y1 = K.bgmv(torch.zeros(13, 48), x, As, Bs, idx, torch.tensor([0.5, 2.0]))
    y2 = K.bgmv(torch.zeros(13, 48), x, *K.stack_padded([A], [B], rank=8), torch.where(idx == 0, 0, -1),
                torch.tensor([0.5]))
    rows0 = idx == 0
    assert torch.equal(y1[rows0], y2[rows0])


@pytest.mark.parametrize("kernel", ["sgmv", "bgmv", "mbgmv"])
def test_no_lora_rows_equal_base_exactly(setup, kernel):
    base, _, adapters = setup
    prompts = _prompts()[:3]
    lens = [len(p) for p in prompts]
    ref = ragged_forward(base, [RequestSlice(p, KVCache()) for p in prompts], None, all_logits=True)
    got = ragged_forward(base, [RequestSlice(p, KVCache()) for p in prompts],
                         _batch(adapters, [None, "r32", None], lens, kernel), all_logits=True)
    assert torch.equal(got[:lens[0]], ref[:lens[0]])
    assert torch.equal(got[lens[0] + lens[1]:], ref[lens[0] + lens[1]:])
    assert not torch.allclose(got[lens[0]:lens[0] + lens[1]], ref[lens[0]:lens[0] + lens[1]])


def test_kernels_skip_negative_index_rows():
    x = torch.randn(4, 8)
    y = torch.randn(4, 6)
    y0 = y.clone()
    A, B = torch.randn(1, 2, 8), torch.randn(1, 6, 2)
    K.bgmv(y, x, A, B, torch.tensor([-1, -1, -1, -1]), torch.tensor([1.0]))
    assert torch.equal(y, y0)


def test_merged_equals_unmerged_and_unmerge_restores_exactly(setup):
    base, _, adapters = setup
    model = copy.deepcopy(base)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = _prompts()[0]
    unmerged = ragged_forward(model, [RequestSlice(p, KVCache())], _batch(adapters, ["r32"], [len(p)], "sgmv"), all_logits=True)
    saved = merge_adapter(model, adapters["r32"])
    merged = ragged_forward(model, [RequestSlice(p, KVCache())], None, all_logits=True)
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-4)
    unmerge_adapter(model, saved)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_peft_save_load_round_trip(setup, tmp_path):
    base, pm, adapters = setup
    save_adapters(pm, tmp_path)
    pm2 = load_peft_model(copy.deepcopy(base), tmp_path, [s.name for s in SPECS])
    again = adapters_from_peft(pm2)
    for name, ad in adapters.items():
        assert again[name].rank == ad.rank and again[name].scale == ad.scale
        for s in ad.A:
            assert torch.equal(again[name].A[s], ad.A[s]) and torch.equal(again[name].B[s], ad.B[s])
        assert ad.B["q_proj"].abs().sum() > 0  # init_lora_weights=False: B is not zero


def test_punica_rejects_unsupported_rank():
    with pytest.raises(ConfigError, match="rank 8 is not supported by the Punica BGMV kernel"):
        K.check_kernel_rank("bgmv_punica", 8, "adapter 'r8'")
    K.check_kernel_rank("bgmv_punica", 32)


def test_in_memory_tokenizer_round_trip():
    tok = build_tokenizer()
    ids = tok("héllo, LoRA")["input_ids"]
    assert ids == encode_bytes("héllo, LoRA")
    assert tok.decode(ids) == "héllo, LoRA"
