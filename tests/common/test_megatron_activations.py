"""Activation memory by module (impl/common/megatron/activations.py) against the storages autograd
saves for backward (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once,
parameters excluded; the method of impl/lobra/real_memory.py) on a faithful small CPU layer of
each architecture: tensor-parallel rank 0 of tp = 2 (collectives emulated by autograd functions
that save nothing, as Megatron's do), bf16, with and without sequence parallelism.

The layer follows Megatron-LM's ParallelTransformerLayer with flash attention (``[s, b, h]``
layout; q, k, v made contiguous for the kernel; the output projection reads the kernel's output
storage): GPT = LayerNorm, bias, GeLU, bias-dropout-add with hidden dropout 0.1; LLaMA =
RMSNorm (fused: saves input and rstd), rotary (cos / sin per application), SwiGLU (chunk, SiLU,
product), no bias, no dropout. Sequence-parallel column linears save the rank's input shard and
gather it again in backward (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from impl.common.megatron import activations as act
from impl.common.megatron.model import MegatronModel

S, H, HEADS, FFN, TP = 64, 64, 4, 256, 2
DT = torch.bfloat16


class _Saves:
    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, tuple[str, int]] = {}
        self.scope = "outside"

    @contextlib.contextmanager
    def module(self, name: str):
        prev, self.scope = self.scope, name
        try:
            yield
        finally:
            self.scope = prev

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen[ptr] = (self.scope, st.nbytes())
        return t

    def by_module(self) -> dict:
        out: dict = {}
        for name, n in self.seen.values():
            out[name] = out.get(name, 0) + n
        return out


class _Gather(torch.autograd.Function):
    """All-gather along the sequence (rank 0's shard repeated: shapes as on the GPU); saves nothing."""

    @staticmethod
    def forward(ctx, x):
        return torch.cat([x] * TP, dim=0)

    @staticmethod
    def backward(ctx, g):
        return g.narrow(0, 0, g.shape[0] // TP).clone()


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.narrow(0, 0, x.shape[0] // TP).clone()

    @staticmethod
    def backward(ctx, g):
        return torch.cat([g] * TP, dim=0)


class _ColumnSP(torch.autograd.Function):
    """Megatron's sequence-parallel column linear: saves the shard, gathers in forward and again in backward."""

    @staticmethod
    def forward(ctx, x_shard, w):
        ctx.save_for_backward(x_shard, w)
        return torch.cat([x_shard] * TP, dim=0) @ w.t()

    @staticmethod
    def backward(ctx, g):
        x_shard, w = ctx.saved_tensors
        x = torch.cat([x_shard] * TP, dim=0)
        gx = (g @ w).narrow(0, 0, x_shard.shape[0]).clone()
        return gx, (g.flatten(0, 1).t() @ x.flatten(0, 1))


class _RMSNorm(torch.autograd.Function):
    """Fused RMSNorm (apex / TE): saves the input and rstd (fp32)."""

    @staticmethod
    def forward(ctx, x, w):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        ctx.save_for_backward(x, rstd, w)
        return (x.float() * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx, g):
        x, rstd, w = ctx.saved_tensors
        xf = x.float()
        n = xf * rstd
        gn = g.float() * w.float()
        gx = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))
        return gx.to(x.dtype), (g.float() * n).sum((0, 1)).to(w.dtype)


def _layer(arch: str, sp: bool, saves: _Saves, x: torch.Tensor, p: dict) -> torch.Tensor:
    gpt = arch == "gpt"
    hd = H // HEADS
    np_ = HEADS // TP

    def norm(name, y):
        with saves.module(name):
            if gpt:
                return F.layer_norm(y, (H,), p[name + "_w"], p[name + "_b"])
            return _RMSNorm.apply(y, p[name + "_w"])

    def column(name, y, w, b=None):
        with saves.module(name):
            out = _ColumnSP.apply(y, w) if sp else F.linear(y, w)
            return out if b is None else out  # bias added by the next fused op (skip_bias_add)

    def reduce(y):
        return _ReduceScatter.apply(y) if sp else y  # all-reduce is the identity on one rank

    def bias_dropout_add(name, y, b, residual):
        with saves.module(name):
            if b is not None:
                y = y + b
            if gpt:
                y = torch.native_dropout(y, 0.1, True)[0]  # the CUDA kernel Megatron runs: a bool mask
            return residual + y

    h1 = norm("norm1", x)
    qkv = column("qkv", h1, p["qkv_w"])
    if gpt:
        qkv = qkv + p["qkv_b"]
    s = qkv.shape[0]
    qkv = qkv.view(s, 1, np_, 3 * hd)
    q, k, v = torch.split(qkv, hd, dim=-1)
    if not gpt:
        with saves.module("rotary"):
            pos = torch.arange(s, dtype=torch.float32)
            inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            freqs = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)[:, None, None, :]

            def rope(t):
                cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
                t1, t2 = t.chunk(2, dim=-1)
                return t * cos + torch.cat([-t2, t1], dim=-1) * sin

            q, k = rope(q), rope(k)
    with saves.module("attention"):
        q, k, v = [t.permute(1, 0, 2, 3).contiguous() for t in (q, k, v)]  # 's b ... -> b s ...'
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        ctx = o.transpose(1, 2).reshape(1, s, np_ * hd).transpose(0, 1)  # 'b s h d -> s b (h d)'
    with saves.module("attention"):
        a = F.linear(ctx, p["proj_w"])
    y = bias_dropout_add("dropout_attn", reduce(a), p.get("proj_b"), x)
    h2 = norm("norm2", y)
    z = column("fc1", h2, p["fc1_w"])
    with saves.module("activation"):
        if gpt:
            z = F.gelu(z + p["fc1_b"], approximate="tanh")
        else:
            gate, up = torch.chunk(z, 2, dim=-1)
            z = F.silu(gate) * up
    with saves.module("fc2"):
        o2 = F.linear(z, p["fc2_w"])
    return bias_dropout_add("dropout_mlp", reduce(o2), p.get("fc2_b"), y)


def _params(arch: str) -> dict:
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(DT).requires_grad_()

    fc1 = FFN if arch == "gpt" else 2 * FFN
    p = {"qkv_w": w(3 * H // TP, H), "proj_w": w(H, H // TP), "fc1_w": w(fc1 // TP, H), "fc2_w": w(H, FFN // TP),
         "norm1_w": w(H), "norm2_w": w(H)}
    if arch == "gpt":
        p.update(qkv_b=w(3 * H // TP), proj_b=w(H), fc1_b=w(FFN // TP), fc2_b=w(H), norm1_b=w(H), norm2_b=w(H))
    return p


def measured(arch: str, sp: bool) -> dict:
    torch.manual_seed(0)
    p = _params(arch)
    saves = _Saves(p.values())
    tokens = S // TP if sp else S
    x = torch.randn(tokens, 1, H).to(DT).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(saves.pack, lambda t: t):
        out = _layer(arch, sp, saves, x, p)
    out.float().sum().backward()  # the saved tensors really serve the backward
    return saves.by_module()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("sp", [False, True])
def test_module_bytes_equal_saved_tensor_bytes(arch, sp):
    model = MegatronModel(arch=arch, num_layers=1, hidden=H, ffn_hidden=FFN, heads=HEADS, vocab=1000,
                          hidden_dropout=0.1 if arch == "gpt" else 0.0)
    derived = {k: v * S for k, v in act.layer_bytes(model, TP, sp, model.dropout).items()}
    got = measured(arch, sp)
    got.pop("outside", None)
    # The output projection saves the attention kernel's output storage: one entry, "attention".
    assert set(got) == set(derived), (sorted(got), sorted(derived))
    for name, b in derived.items():
        assert got[name] == pytest.approx(b, rel=0.05), (name, got[name], b)
    assert sum(got.values()) == pytest.approx(sum(derived.values()), rel=0.02)


def test_sequence_parallel_splits_what_tp_kept_whole():
    m = MegatronModel(arch="gpt", num_layers=1, hidden=4096, ffn_hidden=16384, heads=32, vocab=50257, hidden_dropout=0.1)
    whole, sharded = act.korthikanti_coefficients(m)
    # Korthikanti et al. (flash attention: no s^2 term): 10 h whole + 24 h / t (+ LayerNorm stats, lse).
    assert whole == pytest.approx(10.0, rel=0.01) and sharded == pytest.approx(24.0, rel=0.01)
    assert act.per_token_layer(m, 8, True, 0.1) == pytest.approx(act.per_token_layer(m, 1, False, 0.1) / 8, rel=0.01)
    llama = MegatronModel(arch="llama", num_layers=1, hidden=4096, ffn_hidden=11008, heads=32, kv_heads=8, vocab=32000)
    mha = MegatronModel(arch="llama", num_layers=1, hidden=4096, ffn_hidden=11008, heads=32, vocab=32000)
    # GQA shrinks k and v; SwiGLU keeps gate+up (2 x ffn) and the SiLU output.
    assert act.layer_bytes(mha, 1)["attention"] - act.layer_bytes(llama, 1)["attention"] == pytest.approx(4 * 3072)
    assert act.layer_bytes(llama, 1)["activation"] == 2 * 3 * 11008
