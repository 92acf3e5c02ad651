"""A tiny LLaMA-style decoder that trains on packed variable-length rows (``cu_seqlens``).

Shape from :class:`~impl.common.workloads.pipeline.ModelShape` (HotSPa's real CPU mode,
impl/hotspa/README.md: 4 layers,
hidden 128, 4 heads, SwiGLU FFN 352 via ``ffn_hidden``, vocab 2048, fp32; ``ffn_hidden = 0``
gives a GELU MLP of ``ffn_mult * hidden``). RMSNorm, rotary positions, no biases, untied head.

One forward runs one micro-batch row (:class:`~impl.common.varlen.packing.MicroBatch`): segment
i spans ``[cu_seqlens[i], cu_seqlens[i+1])`` and its first ``seqlens[i]`` tokens are real (all
of them by default); tokens after ``cu_seqlens[-1]`` are alignment padding.
- Attention is causal inside each segment and never crosses one (block-diagonal), and rotary
  positions restart at 0 in each segment, so a packed sequence computes what it computes
  alone. ``attention="segments"`` (default) loops over segments with SDPA ``is_causal``: cost
  ``sum s_i^2`` as in flash-attn varlen, the cost model the papers fit. ``attention="mask"``
  runs one SDPA over the row with a block-diagonal causal boolean mask: cost ``T^2``; it is the
  plain reference the loop is tested against.
- Padding is never a loss target and real tokens never attend to it.
- Loss = sum of token cross-entropies / ``global_tokens``, the caller's count of target tokens
  in the whole step (all micro-batches, groups and ranks), so summing micro-batch gradients
  gives the step's gradient however the step was packed. Without it,
  the micro-batch's own token count (a mean).
- ``checkpoint=True`` recomputes each block in backward (``torch.utils.checkpoint``): Hydraulis
  and LobRA use it as the CPU stand-in for a larger memory footprint.

Tensor-parallel ready: q/k/v/o and gate/up/down are separate ``nn.Linear`` modules and the
attention derives its head count from the local q width, so a Megatron-style plan is the data
in :data:`TP_PLAN` (column-parallel q/k/v/gate/up, row-parallel o/down) mapped to
``ColwiseParallel``/``RowwiseParallel`` per block.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from impl.common.api import ConfigError
from impl.common.models.tiny_gpt import INIT_STD
from impl.common.workloads.pipeline import ModelShape

ATTENTION = ("segments", "mask")
IGNORE = -100
ROPE_THETA = 10000.0

# Per-block module name -> Megatron split ("colwise": output features, "rowwise": input).
TP_PLAN = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
           "mlp.gate": "colwise", "mlp.up": "colwise", "mlp.down": "rowwise"}


def validate_varlen_shape(shape: ModelShape) -> None:
    for name in ("num_layers", "hidden", "heads", "vocab"):
        if getattr(shape, name) < 1:
            raise ConfigError(f"model.{name}: must be >= 1, got {getattr(shape, name)}")
    if shape.hidden % shape.heads:
        raise ConfigError(f"model.hidden: {shape.hidden} is not divisible by model.heads {shape.heads}")
    if (shape.hidden // shape.heads) % 2:
        raise ConfigError(f"model.hidden: head size {shape.hidden // shape.heads} must be even for rotary positions")
    if shape.ffn_hidden < 0 or (not shape.ffn_hidden and shape.ffn_mult < 1):
        raise ConfigError(f"model.ffn_hidden: must be > 0 (SwiGLU) or 0 with model.ffn_mult >= 1, "
                          f"got ffn_hidden {shape.ffn_hidden}, ffn_mult {shape.ffn_mult}")


class SegmentLayout:
    """Per-row segment structure, computed once per forward and shared by every layer."""

    def __init__(self, total: int, cu_seqlens: torch.Tensor, seqlens: Optional[torch.Tensor],
                 device: torch.device) -> None:
        cu = [int(x) for x in torch.as_tensor(cu_seqlens).tolist()]
        if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
            raise ValueError(f"cu_seqlens {cu[:8]}... must start at 0, not decrease and end <= {total} tokens")
        spans = [b - a for a, b in zip(cu, cu[1:])]
        real = spans if seqlens is None else [int(x) for x in torch.as_tensor(seqlens).tolist()]
        if len(real) != len(spans) or any(not 0 <= r <= s for r, s in zip(real, spans)):
            raise ValueError(f"seqlens {real[:8]} must give 0 <= seqlen <= segment span per segment {spans[:8]}")
        self.total, self.cu, self.real = total, cu, real
        # Segment index per token; trailing alignment padding forms one extra segment.
        seg_sizes = spans + [total - cu[-1]]
        seg = torch.repeat_interleave(torch.arange(len(seg_sizes), device=device),
                                      torch.tensor(seg_sizes, device=device))
        starts = torch.tensor(cu, device=device)[seg]
        self.positions = torch.arange(total, device=device) - starts
        real_t = torch.tensor(real + [0], device=device)
        self.valid = self.positions < real_t[seg]
        self.segment = seg

    def mask(self) -> torch.Tensor:
        """[T, T] boolean, True = may attend: same segment and not in the future."""
        same = self.segment[:, None] == self.segment[None, :]
        return same & torch.ones(self.total, self.total, dtype=torch.bool, device=self.segment.device).tril()


def rope(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=positions.device) / head_dim))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    rotated = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rotated * sin


class VarlenAttention(nn.Module):
    def __init__(self, shape: ModelShape, attention: str) -> None:
        super().__init__()
        h = shape.hidden
        self.head_dim = h // shape.heads
        self.attention = attention
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, h, bias=False)
        self.v = nn.Linear(h, h, bias=False)
        self.o = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        # Heads from the local width: under TP each rank holds q.out_features / tp of them.
        q = _apply_rope(self.q(x).view(t, -1, hd).transpose(0, 1), cos, sin)
        k = _apply_rope(self.k(x).view(t, -1, hd).transpose(0, 1), cos, sin)
        v = self.v(x).view(t, -1, hd).transpose(0, 1)
        if self.attention == "mask":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask())
        else:
            cu = layout.cu
            # 4-D inputs: with 3-D ones torch's flash kernels are skipped for one that holds T x T scores
            parts = [F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, a:b], v[None, :, a:b], is_causal=True)[0]
                     for a, b in zip(cu, cu[1:]) if b > a]
            if layout.total > cu[-1]:  # alignment padding: nothing reads it, leave it zero
                parts.append(q.new_zeros(q.shape[0], layout.total - cu[-1], hd))
            y = torch.cat(parts, dim=1) if parts else q.new_zeros(q.shape)
        return self.o(y.transpose(0, 1).reshape(t, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class VarlenBlock(nn.Module):
    def __init__(self, shape: ModelShape, attention: str) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(shape.hidden, eps=1e-6)
        self.attn = VarlenAttention(shape, attention)
        self.mlp_norm = nn.RMSNorm(shape.hidden, eps=1e-6)
        if shape.ffn_hidden:
            self.mlp: nn.Module = SwiGLU(shape.hidden, shape.ffn_hidden)
        else:
            self.mlp = GeluMLP(shape.hidden, shape.ffn_mult * shape.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, layout)
        return x + self.mlp(self.mlp_norm(x))


class VarlenGPT(nn.Module):
    def __init__(self, shape: ModelShape, seed: int, checkpoint: bool = False,
                 attention: str = "segments") -> None:
        super().__init__()
        validate_varlen_shape(shape)
        if attention not in ATTENTION:
            raise ConfigError(f"model.attention: unknown {attention!r} (choose one of {', '.join(ATTENTION)})")
        self.shape = shape
        self.checkpoint = checkpoint
        self.tok_emb = nn.Embedding(shape.vocab, shape.hidden)
        self.blocks = nn.ModuleList(VarlenBlock(shape, attention) for _ in range(shape.num_layers))
        self.norm = nn.RMSNorm(shape.hidden, eps=1e-6)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        self._init(seed)

    def _init(self, seed: int) -> None:
        # As TinyGPT: one explicit generator, parameters in module order -> same model everywhere.
        # (on the weights' device: a paper-shaped model is built where it trains, never on the host)
        dev = self.tok_emb.weight.device
        g = torch.Generator(device=dev if dev.type == "cuda" else "cpu").manual_seed(seed)  # meta: no generator
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Embedding, nn.Linear)):
                    nn.init.normal_(m.weight, 0.0, INIT_STD, generator=g)

    def hidden_states(self, tokens: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
        x = self.tok_emb(tokens)
        # angles in fp32, applied in the activations' dtype (bf16 compute keeps q/k/v one dtype)
        cos, sin = (t.to(x.dtype) for t in rope(layout.positions, self.shape.hidden // self.shape.heads))
        for blk in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = _checkpoint(blk, x, cos, sin, layout, use_reentrant=False)
            else:
                x = blk(x, cos, sin, layout)
        return self.norm(x)

    def logits(self, tokens: torch.Tensor, cu_seqlens, seqlens=None) -> torch.Tensor:
        """[T, vocab] for every position of the row (padding positions included, meaningless)."""
        tokens = tokens.reshape(-1)
        layout = SegmentLayout(tokens.numel(), cu_seqlens, seqlens, tokens.device)
        return self.head(self.hidden_states(tokens, layout))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, cu_seqlens, seqlens=None,
                global_tokens: Optional[int] = None) -> torch.Tensor:
        """Sum of real-token cross-entropies / ``global_tokens`` (default: this row's real tokens)."""
        tokens, targets = tokens.reshape(-1), targets.reshape(-1)
        layout = SegmentLayout(tokens.numel(), cu_seqlens, seqlens, tokens.device)
        x = self.hidden_states(tokens, layout)[layout.valid]
        tgt = targets[layout.valid]
        if (tgt == IGNORE).any():
            raise ValueError("targets: a real token has the ignore target; padding is set by the layout")
        denom = int(layout.valid.sum()) if global_tokens is None else int(global_tokens)
        if denom < 1:
            raise ValueError(f"global_tokens: must be >= 1, got {denom}")
        # the loss in fp32 whatever the compute dtype (Megatron's fp32 cross-entropy)
        return F.cross_entropy(self.head(x).float(), tgt, reduction="sum") / denom


def build_varlen_model(shape: ModelShape, seed: int, checkpoint: bool = False,
                       attention: str = "segments") -> VarlenGPT:
    return VarlenGPT(shape, seed, checkpoint=checkpoint, attention=attention)


def spec5_shape() -> ModelShape:
    """The tiny decoder of HotSPa's real CPU mode (seq_len = the largest micro-batch capacity, 2048)."""
    return ModelShape(name="varlen-tiny", num_layers=4, hidden=128, heads=4, ffn_hidden=352,
                      vocab=2048, seq_len=2048)


def sequence_tokens(seq_id: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """``length + 1`` random token ids for stream sequence ``seq_id`` (inputs and shifted
    targets), the same on every rank for the same (seed, id)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + int(seq_id))
    return torch.randint(0, vocab, (int(length) + 1,), generator=g)


def micro_batch_tensors(mb, vocab: int, seed: int,
                        pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, targets, cu_seqlens, seqlens)`` of a :class:`MicroBatch` row (padding: token
    ``pad_id``, target ``IGNORE``)."""
    tokens = torch.full((mb.padded_len,), pad_id, dtype=torch.long)
    targets = torch.full((mb.padded_len,), IGNORE, dtype=torch.long)
    cu = mb.cu_seqlens
    for i, (sid, length) in enumerate(zip(mb.seq_ids, mb.lengths)):
        seq = sequence_tokens(sid, length, vocab, seed)
        a = int(cu[i])
        tokens[a:a + length] = seq[:-1]
        targets[a:a + length] = seq[1:]
    return (tokens, targets, torch.from_numpy(np.asarray(cu, dtype=np.int32)),
            torch.tensor(mb.lengths, dtype=torch.int32))


def step_target_tokens(micro_batches: Sequence) -> int:
    """The step's global token count: real target tokens over all its micro-batches."""
    return int(sum(mb.num_tokens for mb in micro_batches))
