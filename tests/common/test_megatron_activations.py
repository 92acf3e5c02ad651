"""Activation memory by module (impl/common/megatron/activations.py) and the memory-bound op bytes
of the step model (impl/common/megatron/step.py) against each kernel stack's code as it runs.

Saved bytes: the storages autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``,
each storage counted once, parameters excluded; the method of impl/lobra/real_memory.py) on a small
CPU layer of each stack, tensor-parallel rank 0 of tp 1 and 2 (collectives emulated by autograd
functions that save nothing, as Megatron's do), bf16, with and without sequence parallelism (SP
needs tp > 1). The layers re-state the code each stack runs, op by op
(https://github.com/Sakura-gh/Megatron-LM; ``[s, b, h]`` layout; q, k, v made contiguous for
flash attention as ``ParallelAttention.forward`` does; the output projection reads the kernel's
output storage):

- ``megatron_gpt_fork`` (branch ``sync_files``): apex fused LayerNorm (saves input, mean, rstd:
  ``F.layer_norm`` saves the same), ``megatron/model/fused_bias_gelu.py`` ``GeLUFunction`` (saves
  input and bias), the jit bias-dropout-add with hidden dropout 0.1 (a bool mask), biases.
- ``megatron_llama_fork`` (branch ``llama``): ``megatron/model/rms_norm.py``
  ``self._norm(x.float()).type_as(x) * self.weight``, ``ParallelMLP``'s ``torch.chunk`` +
  ``F.silu(a) * b``, ``rotary_pos_embedding.apply_rotary_pos_emb`` (``t * cos + _rotate_half(t) *
  sin`` and the cat with the pass-through), ``bias_dropout_add`` with dropout 0.0, no biases.
- ``megatron_llama_fused``: a fused RMSNorm that saves input and rstd (apex ``FusedRMSNormAffineFunction``,
  Transformer Engine's norm in ``TELayerNormColumnParallelLinear``), Megatron-Core
  ``megatron/core/fusions/fused_bias_swiglu.py`` ``SwiGLUFunction`` (saves its input), a fused
  RoPE that saves only the angle table (Transformer Engine ``FusedRoPEFunc``), computed once
  outside the layers.

Op bytes: every aten kernel's reads and writes (``TorchDispatchMode``; views are free, a
broadcast input is read once) over one op's forward and backward, as the fork states it.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from impl.common.megatron import activations as act
from impl.common.megatron import step
from impl.common.megatron.model import MegatronModel
from impl.common.megatron.stack import STACKS

S, H, HEADS, FFN = 64, 64, 4, 256
DT = torch.bfloat16
STACK_ARCH = {"megatron_gpt_fork": "gpt", "megatron_llama_fork": "llama", "megatron_llama_fused": "llama"}
LAYOUTS = [(1, False), (2, False), (2, True)]  # (tp, sequence parallel)


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
    def forward(ctx, x, tp):
        ctx.tp = tp
        return torch.cat([x] * tp, dim=0)

    @staticmethod
    def backward(ctx, g):
        return g.narrow(0, 0, g.shape[0] // ctx.tp).clone(), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.narrow(0, 0, x.shape[0] // tp).clone()

    @staticmethod
    def backward(ctx, g):
        return torch.cat([g] * ctx.tp, dim=0), None


class _ColumnSP(torch.autograd.Function):
    """Megatron's sequence-parallel column linear: saves the shard, gathers in forward and again in backward."""

    @staticmethod
    def forward(ctx, x_shard, w, tp):
        ctx.save_for_backward(x_shard, w)
        ctx.tp = tp
        return torch.cat([x_shard] * tp, dim=0) @ w.t()

    @staticmethod
    def backward(ctx, g):
        x_shard, w = ctx.saved_tensors
        x = torch.cat([x_shard] * ctx.tp, dim=0)
        gx = (g @ w).narrow(0, 0, x_shard.shape[0]).clone()
        return gx, (g.flatten(0, 1).t() @ x.flatten(0, 1)), None


class _BiasGeLU(torch.autograd.Function):
    """The GPT fork's ``GeLUFunction`` (fused_bias_gelu.py): saves input and bias."""

    @staticmethod
    def forward(ctx, y, bias):
        ctx.save_for_backward(y, bias)
        x = bias + y
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        y, bias = ctx.saved_tensors
        x = bias + y
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
        return ff * g, (ff * g).sum((0, 1))


class _FusedRMSNorm(torch.autograd.Function):
    """A fused RMSNorm (apex / Transformer Engine): saves the input and rstd (fp32)."""

    @staticmethod
    def forward(ctx, x, w):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        ctx.save_for_backward(x, rstd, w)
        return (x.float() * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx, g):
        x, rstd, w = ctx.saved_tensors
        n = x.float() * rstd
        gn = g.float() * w.float()
        gx = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))
        return gx.to(x.dtype), (g.float() * n).sum((0, 1)).to(w.dtype)


class _FusedSwiGLU(torch.autograd.Function):
    """Megatron-Core ``SwiGLUFunction``: saves its input only."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        a, b = torch.chunk(y, 2, -1)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        a, b = torch.chunk(y.float(), 2, -1)
        s = torch.sigmoid(a)
        return torch.cat((g * s * (1 + a * (1 - s)) * b, g * a * s), -1).to(y.dtype)


class _FusedRoPE(torch.autograd.Function):
    """A fused RoPE kernel: saves the angle table only."""

    @staticmethod
    def forward(ctx, t, freqs):
        ctx.save_for_backward(freqs)
        return _rope_math(t, freqs)

    @staticmethod
    def backward(ctx, g):
        (freqs,) = ctx.saved_tensors
        return _rope_math(g, -freqs), None


def _rope_math(t, freqs):
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    return t * cos + _rotate_half(t) * sin


def _rotate_half(x):
    """The fork's ``_rotate_half``."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    """The fork's ``apply_rotary_pos_emb`` (rotary_pos_embedding.py, branch llama)."""
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = torch.cos(freqs).to(t.dtype)
    sin_ = torch.sin(freqs).to(t.dtype)
    t = (t * cos_) + (_rotate_half(t) * sin_)
    return torch.cat((t, t_pass), dim=-1)


def rms_norm_fork(x, weight, eps=1e-5):
    """The fork's ``RMSNorm.forward`` (rms_norm.py, branch llama)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def swiglu_fork(x):
    """The fork's ``ParallelMLP`` swiglu (transformer.py, branch llama)."""
    x = torch.chunk(x, 2, dim=-1)
    return F.silu(x[0]) * x[1]


def bias_dropout_add(x, bias, residual, prob, training=True):
    """The fork's ``bias_dropout_add`` (transformer.py)."""
    if bias is not None:
        x = x + bias
    out = torch.nn.functional.dropout(x, p=prob, training=training)
    return residual + out


def _freqs(s: int, hd: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    return torch.cat([torch.outer(torch.arange(s, dtype=torch.float32), inv)] * 2, dim=-1)[:, None, None, :]


def _layer(name: str, tp: int, sp: bool, saves: _Saves, x: torch.Tensor, p: dict) -> torch.Tensor:
    gpt = STACK_ARCH[name] == "gpt"
    fused = name == "megatron_llama_fused"
    hd = H // HEADS
    np_ = HEADS // tp

    def norm(module, y):
        with saves.module(module):
            if gpt:
                return F.layer_norm(y, (H,), p[module + "_w"], p[module + "_b"])
            if fused:
                return _FusedRMSNorm.apply(y, p[module + "_w"])
            return rms_norm_fork(y, p[module + "_w"])

    def column(module, y, w):
        with saves.module(module):
            return _ColumnSP.apply(y, w, tp) if sp else F.linear(y, w)  # bias: skip_bias_add

    def reduce(y):
        return _ReduceScatter.apply(y, tp) if sp else y  # all-reduce is the identity on one rank

    def residual_add(module, y, b, residual):
        with saves.module(module):
            if gpt:
                # The jit-fused bias-dropout-add on the GPU: the CUDA dropout kernel's bool mask.
                return residual + torch.native_dropout(y + b, 0.1, True)[0]
            return bias_dropout_add(y, None, residual, 0.0)

    h1 = norm("norm1", x)
    qkv = column("qkv", h1, p["qkv_w"])
    if gpt:
        qkv = qkv + p["qkv_b"]
    s = qkv.shape[0]
    qkv = qkv.view(s, 1, np_, 3 * hd)
    q, k, v = torch.split(qkv, hd, dim=-1)
    if not gpt:
        freqs = _freqs(s, hd)  # RotaryEmbedding.forward, once per model forward
        saves.pack(freqs)  # every layer's fused RoPE keeps this one storage: outside the layer
        with saves.module("rotary"):
            if fused:
                q, k = _FusedRoPE.apply(q, freqs), _FusedRoPE.apply(k, freqs)
            else:
                q, k = apply_rotary_pos_emb(q, freqs), apply_rotary_pos_emb(k, freqs)
    with saves.module("attention"):
        q, k, v = [t.permute(1, 0, 2, 3).contiguous() for t in (q, k, v)]  # 's b ... -> b s ...'
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        ctx = o.transpose(1, 2).reshape(1, s, np_ * hd).transpose(0, 1)  # 'b s h d -> s b (h d)'
        a = F.linear(ctx, p["proj_w"])
    y = residual_add("dropout_attn", reduce(a), p.get("proj_b"), x)
    h2 = norm("norm2", y)
    z = column("fc1", h2, p["fc1_w"])
    with saves.module("activation"):
        if gpt:
            z = _BiasGeLU.apply(z, p["fc1_b"])
        elif fused:
            z = _FusedSwiGLU.apply(z)
        else:
            z = swiglu_fork(z)
    with saves.module("fc2"):
        o2 = F.linear(z, p["fc2_w"])
    return residual_add("dropout_mlp", reduce(o2), p.get("fc2_b"), y)


def _params(gpt: bool, tp: int) -> dict:
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(DT).requires_grad_()

    fc1 = FFN if gpt else 2 * FFN
    p = {"qkv_w": w(3 * H // tp, H), "proj_w": w(H, H // tp), "fc1_w": w(fc1 // tp, H), "fc2_w": w(H, FFN // tp),
         "norm1_w": w(H), "norm2_w": w(H)}
    if gpt:
        p.update(qkv_b=w(3 * H // tp), proj_b=w(H), fc1_b=w(FFN // tp), fc2_b=w(H), norm1_b=w(H), norm2_b=w(H))
    return p


def measured(name: str, tp: int, sp: bool) -> dict:
    torch.manual_seed(0)
    p = _params(STACK_ARCH[name] == "gpt", tp)
    saves = _Saves(p.values())
    x = torch.randn(S // tp if sp else S, 1, H).to(DT).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(saves.pack, lambda t: t):
        out = _layer(name, tp, sp, saves, x, p)
    out.float().sum().backward()  # the saved tensors really serve the backward
    return saves.by_module()


def _model(name: str) -> MegatronModel:
    return MegatronModel(arch=STACK_ARCH[name], num_layers=1, hidden=H, ffn_hidden=FFN, heads=HEADS, vocab=1000,
                         stack=STACKS[name])


@pytest.mark.parametrize("name", sorted(STACK_ARCH))
@pytest.mark.parametrize("tp,sp", LAYOUTS)
def test_module_bytes_equal_saved_tensor_bytes(name, tp, sp):
    model = _model(name)
    derived = {k: v * S for k, v in act.layer_bytes(model, tp, sp, model.dropout).items()}
    got = measured(name, tp, sp)
    got.pop("outside", None)  # the fused RoPE's angle table: one storage for every layer
    # No dropout: its bias-dropout-add saves nothing, so the model lists no entry.
    assert set(got) == set(derived), (sorted(got), sorted(derived))
    for module, b in derived.items():
        assert got[module] == pytest.approx(b, rel=0.03), (module, got[module], b)
    assert sum(got.values()) == pytest.approx(sum(derived.values()), rel=0.03)


def test_plain_rmsnorm_saves_the_fp32_copy_and_not_its_input():
    """What the fork's RMSNorm keeps, by storage: the fp32 copy (4 B), rstd, the bf16 normalised output."""
    x = torch.randn(S, 1, H).to(DT).requires_grad_()
    w = torch.ones(H, dtype=DT, requires_grad=True)
    saves = _Saves([w])
    with torch.autograd.graph.saved_tensors_hooks(saves.pack, lambda t: t):
        rms_norm_fork(x, w)
    sizes = sorted(n for _, n in saves.seen.values())
    assert sizes == sorted([S * 4, S * H * 2, S * H * 4])
    assert x.untyped_storage().data_ptr() not in saves.seen


def test_gpt_numbers_do_not_move():
    """The February fit prices GPT with these closed forms (Korthikanti et al. 2022 Table 2 with
    flash attention; the former elementwise passes): the stack must leave them as they were."""
    for tp, sp in [(1, False), (2, False), (4, True), (8, True), (8, False)]:
        m = MegatronModel(arch="gpt", num_layers=1, hidden=4096, ffn_hidden=16384, heads=32, vocab=50257)
        h, f, a = 4096, 16384, 32
        t, s = float(tp), float(tp if sp else 1)
        layer = (2 * (2 * h + 8) + 2 * h + 2 * h) / s + 2 * (4 * h) / t + 4 * a / t + 2 * f / t + 2 * f / t
        layer += 2 * h / s  # two dropout masks of 1 B
        assert act.per_token_layer(m, tp, sp, m.dropout) == pytest.approx(layer, rel=1e-12)
        elem = 2.0 * (2 * 5 * h + 2 * 7 * h) / s + 2.0 * 5 * f / t + 2.0 * 4 * (3 * h) / t
        assert step.elementwise_bytes(m, tp, sp) == pytest.approx(elem, rel=1e-12)


def test_llama_fork_costs_more_than_fused():
    fork, fused = _model("megatron_llama_fork"), _model("megatron_llama_fused")
    for tp, sp in LAYOUTS:
        assert act.per_token_layer(fork, tp, sp) > act.per_token_layer(fused, tp, sp)
        assert step.elementwise_bytes(fork, tp, sp) > step.elementwise_bytes(fused, tp, sp)


class _Traffic(TorchDispatchMode):
    """Bytes every aten kernel reads and writes; views are free, a broadcast input is read once."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.bytes += sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in ins)
        self.bytes += sum(t.numel() * t.element_size() for t in outs)
        return out


def _traffic(fn, *inputs) -> int:
    """HBM bytes of ``fn``'s forward and backward (gradients returned, not accumulated into leaves)."""
    g = torch.ones_like(fn(*inputs))
    with _Traffic() as c:
        y = fn(*inputs)
        torch.autograd.grad(y, [t for t in inputs if t.requires_grad], g)
    return c.bytes


def _leaf(*shape):
    return torch.randn(*shape).to(DT).requires_grad_()


def test_plain_op_bytes_are_the_forks_kernels():
    w = _leaf(H)
    assert _traffic(rms_norm_fork, _leaf(S, 1, H), w) == pytest.approx(step.NORM_TORCH_FP32_BYTES * S * H, rel=0.03)
    assert _traffic(swiglu_fork, _leaf(S, 1, 2 * FFN)) == pytest.approx(step.SWIGLU_PLAIN_BYTES * S * FFN, rel=0.03)
    hd = H // HEADS
    freqs = _freqs(S, hd)
    rope = _traffic(lambda t: apply_rotary_pos_emb(t, freqs), _leaf(S, 1, HEADS, hd))
    # The step model nets out the q / k copy flash attention then skips (4 B per element).
    expect = (step.ROPE_PLAIN_BYTES + 4.0) * S * H + step.ROPE_PLAIN_TABLE_BYTES * S * hd
    assert rope == pytest.approx(expect, rel=0.03)
    gelu = _traffic(lambda y, b: F.gelu(y + b, approximate="tanh"), _leaf(S, 1, FFN), _leaf(FFN))
    assert gelu == pytest.approx(step.GELU_PLAIN_BYTES * S * FFN, rel=0.03)
    resid = _traffic(lambda r, y: bias_dropout_add(y, None, r, 0.0), _leaf(S, 1, H), _leaf(S, 1, H))
    # Forward only here: the backward's residual-gradient sum happens where the stream forks.
    assert resid == pytest.approx(step.RESIDUAL_PLAIN_BYTES / 2 * S * H, rel=0.03)


def test_sequence_parallel_splits_what_tp_kept_whole():
    m = MegatronModel(arch="gpt", num_layers=1, hidden=4096, ffn_hidden=16384, heads=32, vocab=50257, hidden_dropout=0.1)
    whole, sharded = act.korthikanti_coefficients(m)
    # Korthikanti et al. (flash attention: no s^2 term): 10 h whole + 24 h / t (+ LayerNorm stats, lse).
    assert whole == pytest.approx(10.0, rel=0.01) and sharded == pytest.approx(24.0, rel=0.01)
    assert act.per_token_layer(m, 8, True, 0.1) == pytest.approx(act.per_token_layer(m, 1, False, 0.1) / 8, rel=0.01)
    llama = MegatronModel(arch="llama", num_layers=1, hidden=4096, ffn_hidden=11008, heads=32, kv_heads=8, vocab=32000)
    mha = MegatronModel(arch="llama", num_layers=1, hidden=4096, ffn_hidden=11008, heads=32, vocab=32000)
    # GQA shrinks k and v; the fork's SwiGLU keeps gate+up (2 x ffn) and the SiLU output.
    assert act.layer_bytes(mha, 1)["attention"] - act.layer_bytes(llama, 1)["attention"] == pytest.approx(4 * 3072)
    assert act.layer_bytes(llama, 1)["activation"] == 2 * 3 * 11008
