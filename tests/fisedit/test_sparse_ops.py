"""Per-op invariants (impl/fisedit/README.md, "Correctness invariants"): sparse == dense on active
cells, == cache elsewhere."""
import pytest
import torch
from diffusers.models.attention import BasicTransformerBlock

from impl.fisedit.sparse_modules import CachedTransformerBlock, EngineState
from impl.fisedit.sparse import block_mask, conv_geometry, expand_blocks, sparse_conv2d, sparse_token_linear


def _mask(h, w, seed, density=0.15):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(h, w, generator=g) < density
    m[0, 0] = m[-1, -1] = m[0, -1] = True  # borders and corners always included
    return m


@pytest.mark.parametrize("k,s,p", [(3, 1, 1), (3, 2, 1), (1, 1, 0)])
@pytest.mark.parametrize("hw", [(16, 16), (13, 11)])
@pytest.mark.parametrize("block", [1, 2, 3, 4])
def test_sparse_conv_matches_dense_on_active_and_cache_elsewhere(k, s, p, hw, block):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(5, 7, k, stride=s, padding=p)
    x = torch.randn(2, 5, *hw)
    with torch.no_grad():
        dense = conv(x)
        cached = torch.randn_like(dense)
        Ho, Wo = dense.shape[-2:]
        m = _mask(Ho, Wo, seed=k + s + block)
        out = sparse_conv2d(x, conv, m, cached, block)
    if k == 1:
        active = m
    else:
        bo = conv_geometry(conv, block)["bo"]
        active = expand_blocks(block_mask(m, bo), bo, Ho, Wo)
    assert active[m].all()
    a = active.expand_as(dense)
    torch.testing.assert_close(out[a], dense[a], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~a], cached[~a])


def test_sparse_conv_empty_and_full_masks():
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad():
        dense = conv(x)
        cached = torch.randn_like(dense)
        assert torch.equal(sparse_conv2d(x, conv, torch.zeros(10, 10, dtype=torch.bool), cached), cached)
        torch.testing.assert_close(sparse_conv2d(x, conv, torch.ones(10, 10, dtype=torch.bool), cached), dense,
                                   rtol=1e-5, atol=1e-5)


def test_sparse_conv_rejects_wrong_mask_shape():
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError, match="does not match output"):
        sparse_conv2d(x, conv, torch.ones(4, 4, dtype=torch.bool), torch.zeros(1, 4, 8, 8))


def test_sparse_token_linear():
    lin = torch.nn.Linear(6, 9)
    x = torch.randn(2, 20, 6)
    idx = torch.tensor([0, 3, 19])
    with torch.no_grad():
        dense = lin(x)
        cached = torch.randn_like(dense)
        out = sparse_token_linear(x, lin, idx, cached)
    act = torch.zeros(20, dtype=torch.bool)
    act[idx] = True
    torch.testing.assert_close(out[:, act], dense[:, act])
    assert torch.equal(out[:, ~act], cached[:, ~act])


def test_sparse_attention_block_matches_dense_on_active_tokens():
    torch.manual_seed(0)
    blk = BasicTransformerBlock(32, 4, 8, cross_attention_dim=16).eval()
    st = EngineState(latent_hw=(8, 8), attn_min_cells=1)
    w = CachedTransformerBlock("blk", blk, st)
    h = torch.randn(2, 64, 32)
    text = torch.randn(2, 7, 16)
    m = _mask(8, 8, seed=3)
    with torch.no_grad():
        dense = blk(h, encoder_hidden_states=text)
        cached = torch.randn_like(dense)

        class _C:
            def get(self, step, name, device=None):
                return cached

        st.mode, st.sparse, st.cache = "edit", True, _C()
        st.set_mask(m)
        out = w(h, encoder_hidden_states=text)
    a = m.flatten()
    torch.testing.assert_close(out[:, a], dense[:, a], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, ~a], cached[:, ~a])
