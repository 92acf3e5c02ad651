"""One training rank of a LLaMA decoder as Megatron-LM builds it, for rank-0 estimates and runs.

Built from the shape's ``transformers.LlamaConfig`` (:func:`impl.common.llm.model.llama_config`),
holding only what TP rank ``tp_rank`` of ``tp`` holds in Megatron-LM (``megatron/core/tensor_parallel``):
the vocab-parallel embedding (``VocabParallelEmbedding``: ``padded_vocab / tp`` rows, masked
lookup, all-reduce), per layer a fused QKV and a fused gate/up column-parallel linear, the
attention output and down projections row-parallel (Megatron's ``f`` before each column-parallel
pair, ``g`` after each row-parallel one), RMSNorms whole, an untied column-parallel output layer
and the vocab-parallel cross-entropy (``_VocabParallelCrossEntropy``: fp32 logits, one saved
softmax of ``tokens x vocab / tp``).

The training stack around it (:class:`RankStack`, :class:`RankOptimizer`) follows Megatron's
defaults: bf16 parameters, an fp32 gradient buffer (``DistributedDataParallel``'s ``main_grad``),
and the distributed optimizer (fp32 master weights and Adam's two moments for ``1/dp`` of that
buffer, reduce-scatter of the gradients and all-gather of the updated weights over the DP group).
With ``lora_rank`` > 0 the base is frozen and each of ``lora_tasks`` adapters (``r x (d_in +
d_out)`` on q, k, v, o, gate, up, down, LobRA's targets) trains on the rows of its task:
only the adapters have gradients and optimizer state. ``recompute: full`` checkpoints every layer.

The collectives go to whatever process group is initialised: a real one for a real run, torch's
fake process group for one rank of a larger layout (:mod:`impl.common.runtime.rank0`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from impl.common.api import ConfigError
from impl.common.megatron.model import padded_vocab
from impl.common.models.varlen_gpt import rope
from impl.common.parallel.tensor_parallel import _CopyToTP, _ReduceFromTP  # Megatron's f and g

RECOMPUTE = ("none", "full")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class RankStack:
    """What one rank holds and how it trains (Megatron's arguments of the same names)."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    dtype: str = "bf16"
    recompute: str = "none"
    distributed_optimizer: bool = True
    lora_rank: int = 0  # 0: full-parameter training
    lora_tasks: int = 0

    def __post_init__(self) -> None:
        for f in ("tp", "dp", "pp"):
            if getattr(self, f) < 1:
                raise ConfigError(f"layout.{f}: must be >= 1, got {getattr(self, f)}")
        if self.pp != 1:
            raise ConfigError(f"layout.pp: the rank-0 builder holds one pipeline stage of the whole model (pp 1), "
                              f"got {self.pp}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute: unknown {self.recompute!r} (one of: {', '.join(RECOMPUTE)})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: unknown {self.dtype!r} (one of: {', '.join(DTYPES)})")
        if self.lora_rank < 0 or (self.lora_rank > 0) != (self.lora_tasks > 0):
            raise ConfigError(f"lora: rank {self.lora_rank} and tasks {self.lora_tasks} must both be > 0 or both 0")

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp


class _VocabParallelCE(torch.autograd.Function):
    """Megatron's ``_VocabParallelCrossEntropy``: per-token loss over vocab shards; saves the fp32
    softmax of this rank's shard (reused in place for the gradient)."""

    @staticmethod
    def forward(ctx, logits, target, lo, group):  # type: ignore[override]
        logits = logits.float()
        mx = logits.max(dim=-1).values
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        logits = logits - mx.unsqueeze(-1)
        local = target - lo
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.clamp(0, logits.shape[-1] - 1)
        picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        dist.all_reduce(picked, group=group)
        exp = logits.exp_()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(exp, local, inside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        softmax, local, inside = ctx.saved_tensors
        g = softmax  # in place, as Megatron does: the softmax is not needed afterwards
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        g.mul_(grad.unsqueeze(-1))
        return g, None, None, None


class LoRAs(nn.Module):
    """One adapter per task on a linear of ``d_in -> d_out`` (this rank's shard of it)."""

    def __init__(self, tasks: int, rank: int, d_in: int, d_out: int, alpha: float) -> None:
        super().__init__()
        self.a = nn.ParameterList([nn.Parameter(torch.empty(rank, d_in)) for _ in range(tasks)])
        self.b = nn.ParameterList([nn.Parameter(torch.zeros(d_out, rank)) for _ in range(tasks)])
        self.scale = alpha / rank
        for a in self.a:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor, y: torch.Tensor, rows: Sequence[tuple[int, int]]) -> torch.Tensor:
        parts = [y[a:b] + (x[a:b] @ self.a[t].t() @ self.b[t].t()) * self.scale if b > a else y[a:b]
                 for t, (a, b) in enumerate(rows)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]


class _Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int, lora: Optional[tuple[int, int, float]]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.lora = LoRAs(lora[0], lora[1], d_in, d_out, lora[2]) if lora else None

    def forward(self, x: torch.Tensor, rows) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return self.lora(x, y, rows) if self.lora is not None else y


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as Megatron's fused kernels run it (Transformer Engine / apex ``FusedRMSNorm``):
    fp32 inside, only the input and the fp32 ``rstd`` per token kept for backward. ``F.rms_norm``
    on the CPU decomposes into ops that keep two fp32 copies of the input per norm."""

    @staticmethod
    def forward(ctx, x, w, eps):  # type: ignore[override]
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd)
        return (xf * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        gy = grad.float() * w.float()
        gx = rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))
        gw = (grad.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
        return gx.to(x.dtype), gw.to(w.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedRMSNorm.apply(x, self.weight, self.eps)


class Layer(nn.Module):
    def __init__(self, cfg, tp: int, group, lora) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
        self.heads, self.kv_heads, self.hd = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp, hd
        self.group = group
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv = _Linear(h, (self.heads + 2 * self.kv_heads) * hd, lora)
        self.o = _Linear(self.heads * hd, h, lora)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc1 = _Linear(h, 2 * cfg.intermediate_size // tp, lora)
        self.fc2 = _Linear(cfg.intermediate_size // tp, h, lora)

    def forward(self, x, cos, sin, cu: Sequence[int], rows) -> torch.Tensor:
        t = x.shape[0]
        y = _CopyToTP.apply(self.input_norm(x), self.group)
        q, k, v = self.qkv(y, rows).split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd],
                                           dim=-1)
        q, k = (_rope(z.view(t, -1, self.hd).transpose(0, 1), cos, sin) for z in (q, k))
        v = v.view(t, -1, self.hd).transpose(0, 1)
        rep = self.heads // self.kv_heads
        # one causal attention per packed document (the varlen kernel's work, cu_seqlens); 4-D
        # inputs, or torch falls back from the flash kernel to one that materialises T x T scores
        parts = [F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, a:b], v[None, :, a:b], is_causal=True,
                                                enable_gqa=rep > 1)[0]
                 for a, b in zip(cu, cu[1:]) if b > a]
        a = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        x = x + _ReduceFromTP.apply(self.o(a.transpose(0, 1).reshape(t, -1), rows), self.group)
        y = _CopyToTP.apply(self.post_norm(x), self.group)
        gate, up = self.fc1(y, rows).chunk(2, dim=-1)
        return x + _ReduceFromTP.apply(self.fc2(F.silu(gate) * up, rows), self.group)


def _rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


class MegatronLlamaRank(nn.Module):
    """TP rank ``tp_rank`` of ``stack.tp`` (one pipeline stage holding every layer)."""

    def __init__(self, cfg, stack: RankStack, tp_rank: int = 0, group=None, lora_alpha: float = 16.0) -> None:
        super().__init__()
        tp = stack.tp
        for name, n in (("num_attention_heads", cfg.num_attention_heads),
                        ("num_key_value_heads", cfg.num_key_value_heads), ("intermediate_size", cfg.intermediate_size)):
            if n % tp:
                raise ConfigError(f"layout.tp: {tp} does not divide the model's {name} {n}")
        self.cfg, self.stack, self.group = cfg, stack, group
        self.vocab = padded_vocab(cfg.vocab_size, tp)
        self.vocab_lo = tp_rank * self.vocab // tp
        h = cfg.hidden_size
        lora = (stack.lora_tasks, stack.lora_rank, lora_alpha) if stack.lora_rank else None
        self.embedding = nn.Parameter(torch.empty(self.vocab // tp, h))
        self.layers = nn.ModuleList([Layer(cfg, tp, group, lora) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.output = nn.Parameter(torch.empty(self.vocab // tp, h))
        dev = self.embedding.device
        g = torch.Generator(device=dev if dev.type == "cuda" else "cpu").manual_seed(0)
        for n, p in self.named_parameters():
            if p.dim() == 2 and ".lora." not in n:
                nn.init.normal_(p, 0.0, cfg.initializer_range, generator=g)
        if lora:
            # the frozen base as buffers: state that never has a gradient (torch's MemTracker
            # hooks every parameter's gradient, and a frozen one has none to hook)
            for n, p in list(self.named_parameters()):
                if ".lora." not in n:
                    owner, _, leaf = n.rpartition(".")
                    mod = self.get_submodule(owner) if owner else self
                    del mod._parameters[leaf]
                    mod.register_buffer(leaf, p.detach())

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_lo
        outside = (local < 0) | (local >= self.embedding.shape[0])
        x = F.embedding(local.clamp(0, self.embedding.shape[0] - 1), self.embedding)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(x, self.group)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor, cu: Sequence[int],
                rows: Sequence[tuple[int, int]] = ((0, 0),), denom: Optional[int] = None) -> torch.Tensor:
        """Sum of token cross-entropies / ``denom`` (default: the row's tokens). ``cu``: document
        offsets in the packed row; ``rows``: token ranges of each LoRA task."""
        x = self._embed(tokens)
        cos, sin = (t.to(x.dtype) for t in rope(positions, self.cfg.hidden_size // self.cfg.num_attention_heads))
        rows = tuple(rows) if self.stack.lora_rank else ((0, tokens.shape[0]),)
        for layer in self.layers:
            if self.stack.recompute == "full" and torch.is_grad_enabled():
                x = _checkpoint(layer, x, cos, sin, cu, rows, use_reentrant=False)
            else:
                x = layer(x, cos, sin, cu, rows)
        x = _CopyToTP.apply(self.final_norm(x), self.group)
        loss = _VocabParallelCE.apply(F.linear(x, self.output), targets, self.vocab_lo, self.group)
        return loss.sum() / (denom or tokens.shape[0])


class RankOptimizer:
    """Megatron's DDP and distributed optimizer on one rank: bf16 parameters, an fp32 gradient
    buffer filled as each gradient is produced, fp32 master weights and Adam for this rank's
    ``1/dp`` of the buffer; :meth:`step` reduce-scatters the buffer, steps Adam and all-gathers the
    updated weights back into the parameters."""

    def __init__(self, model: MegatronLlamaRank, lr: float = 1e-4, dp_group=None) -> None:
        self.model, self.dp, self.dp_group = model, model.stack.dp, dp_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in self.params)
        self.shard = -(-n // self.dp) if model.stack.distributed_optimizer else n
        device = self.params[0].device
        self.main_grad = torch.zeros(self.shard * self.dp, dtype=torch.float32, device=device)
        self.views, off = [], 0
        for p in self.params:
            self.views.append(self.main_grad[off:off + p.numel()].view_as(p))
            off += p.numel()
        for p, v in zip(self.params, self.views):
            p.register_post_accumulate_grad_hook(_into(v))
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        mine = torch.zeros(self.shard, dtype=torch.float32, device=device)
        mine[:min(self.shard, flat.numel())] = flat[:self.shard]
        del flat
        self.master = nn.Parameter(mine)
        self.opt = torch.optim.Adam([self.master], lr=lr)

    def step(self) -> None:
        if self.dp > 1 and self.model.stack.distributed_optimizer:
            grad = torch.empty(self.shard, dtype=torch.float32, device=self.main_grad.device)
            dist.reduce_scatter_single(grad, self.main_grad, group=self.dp_group)
        else:
            if self.dp > 1:
                dist.all_reduce(self.main_grad, group=self.dp_group)
            grad = self.main_grad[:self.shard]
        self.master.grad = grad
        self.opt.step()
        self.master.grad = None
        # the updated weights of every shard, cast to the parameters' dtype, back into place
        full = torch.empty(self.shard * self.dp, dtype=self.params[0].dtype, device=self.main_grad.device)
        if self.dp > 1 and self.model.stack.distributed_optimizer:
            dist.all_gather_single(full, self.master.detach().to(full.dtype), group=self.dp_group)
        else:
            full[:self.shard].copy_(self.master.detach())
        off = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(full[off:off + p.numel()].view_as(p))
                off += p.numel()
        del full
        self.main_grad.zero_()


def _into(view: torch.Tensor):
    def hook(p: torch.Tensor) -> None:
        view.add_(p.grad)
        p.grad = None

    return hook


def build_rank(shape, stack: RankStack, tp_rank: int = 0, group=None, device=None,
               lora_alpha: float = 16.0) -> MegatronLlamaRank:
    """The rank's module from the workload's LLaMA shape, in the stack's dtype on ``device``
    (built in that dtype: no fp32 copy of a paper-scale model is ever made)."""
    from impl.common.llm.model import llama_config

    if not shape.ffn_hidden:
        raise ConfigError(f"workload.model.ffn_hidden: the Megatron rank builder is LLaMA-only (SwiGLU width > 0), "
                          f"got {shape.ffn_hidden}")
    cfg = llama_config(shape)
    before = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[stack.dtype])
    try:
        with torch.device(device or "cpu"):
            return MegatronLlamaRank(cfg, stack, tp_rank, group, lora_alpha)
    finally:
        torch.set_default_dtype(before)
