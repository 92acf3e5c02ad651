"""A tiny GPT (token+position embedding, pre-LN transformer blocks, LM head) for real runs.

Every pipeline stage is cut out of the *same* seeded full model (:func:`build_stage`), so a
pipelined run computes exactly what the single-process model computes; the reference
functions here (:func:`reference_step`, :func:`reference_train`) are what the runtime's
equality tests compare against. The attention and MLP projections and the LM head are
:class:`~impl.common.models.bw_split.SplitLinear` layers, so their weight gradients can be
deferred to a ZeroBubble "W" step.

Parameter names are the full model's (``blocks.3.attn.qkv.weight``) on every stage, so a
stage's tensors can be compared with the reference by name.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from impl.common.api import ConfigError
from impl.common.models.bw_split import SplitLinear
from impl.common.workloads.pipeline import ModelShape

INIT_STD = 0.02


def validate_shape(shape: ModelShape, num_stages: int) -> None:
    if num_stages < 1:
        raise ConfigError(f"workload.stages: need at least 1 stage, got {num_stages}")
    if shape.num_layers < num_stages:
        raise ConfigError(f"model.num_layers: {shape.num_layers} layers cannot be split over "
                          f"{num_stages} stages (need at least one per stage)")
    if shape.hidden % shape.heads != 0:
        raise ConfigError(f"model.hidden: {shape.hidden} is not divisible by model.heads {shape.heads}")
    for name in ("hidden", "heads", "ffn_mult", "vocab", "seq_len"):
        if getattr(shape, name) < 1:
            raise ConfigError(f"model.{name}: must be >= 1, got {getattr(shape, name)}")


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous block ranges per stage; the first ``num_layers % num_stages`` get one more."""
    base, extra = divmod(num_layers, num_stages)
    out, lo = [], 0
    for s in range(num_stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.qkv = SplitLinear(shape.hidden, 3 * shape.hidden)
        self.proj = SplitLinear(shape.hidden, shape.hidden)
        mask = torch.tril(torch.ones(shape.seq_len, shape.seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        # Written out rather than SDPA so every backend runs the same deterministic kernels.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.fc = SplitLinear(shape.hidden, shape.ffn_mult * shape.hidden)
        self.out = SplitLinear(shape.ffn_mult * shape.hidden, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(shape.hidden)
        self.attn = CausalSelfAttention(shape)
        self.ln2 = nn.LayerNorm(shape.hidden)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """The full model; stages are slices of it."""

    def __init__(self, shape: ModelShape, seed: int) -> None:
        super().__init__()
        self.shape = shape
        self.tok_emb = nn.Embedding(shape.vocab, shape.hidden)
        self.pos_emb = nn.Embedding(shape.seq_len, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.num_layers))
        self.ln_f = nn.LayerNorm(shape.hidden)
        self.head = SplitLinear(shape.hidden, shape.vocab, bias=False)
        self._init(seed)

    def _init(self, seed: int) -> None:
        # One explicit generator, parameters drawn in module order: the same seed gives the
        # same model in every process, whatever else touched the global RNG.
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Embedding, SplitLinear)):
                    nn.init.normal_(m.weight, 0.0, INIT_STD, generator=g)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = embed(self.tok_emb, self.pos_emb, tokens)
        for blk in self.blocks:
            x = blk(x)
        return lm_loss(self.ln_f, self.head, x, targets)


def embed(tok_emb: nn.Embedding, pos_emb: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    return tok_emb(tokens) + pos_emb(pos)


def lm_loss(ln_f: nn.LayerNorm, head: SplitLinear, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(ln_f(x))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class PipelineStage(nn.Module):
    """Stage ``stage`` of ``num_stages``: its blocks, plus the embeddings (first) and the
    final LayerNorm + LM head + loss (last). ``forward`` returns the boundary activation, or
    the micro-batch's mean token loss on the last stage."""

    def __init__(self, full: TinyGPT, stage: int, num_stages: int) -> None:
        super().__init__()
        if not 0 <= stage < num_stages:
            raise ConfigError(f"stage: {stage} is not in [0, {num_stages})")
        self.stage = stage
        self.num_stages = num_stages
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.layer_range = stage_layer_ranges(len(full.blocks), num_stages)[stage]
        self.hidden = full.shape.hidden
        self.seq_len = full.shape.seq_len
        if self.is_first:
            self.tok_emb = full.tok_emb
            self.pos_emb = full.pos_emb
        # ModuleDict keyed by the global block index keeps the full model's parameter names.
        self.blocks = nn.ModuleDict({str(i): full.blocks[i] for i in self.layer_range})
        if self.is_last:
            self.ln_f = full.ln_f
            self.head = full.head

    def boundary_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """Shape of the activation (and its gradient) crossing a stage boundary."""
        return (micro_batch_size, self.seq_len, self.hidden)

    def forward(self, inp: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = embed(self.tok_emb, self.pos_emb, inp) if self.is_first else inp
        for blk in self.blocks.values():
            x = blk(x)
        if self.is_last:
            if targets is None:
                raise ValueError(f"stage {self.stage} is the last stage and needs targets")
            return lm_loss(self.ln_f, self.head, x, targets)
        return x


def build_full_model(shape: ModelShape, seed: int) -> TinyGPT:
    validate_shape(shape, 1)
    return TinyGPT(shape, seed)


def build_stage(shape: ModelShape, stage: int, num_stages: int, seed: int) -> PipelineStage:
    """Stage ``stage`` of the seeded full model (built whole, then sliced: exact split)."""
    validate_shape(shape, num_stages)
    return PipelineStage(TinyGPT(shape, seed), stage, num_stages)


def make_microbatches(shape: ModelShape, micro_batch_size: int, num_microbatches: int, seed: int,
                      iteration: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic random next-token data for one iteration: ``[(tokens, targets)] * N``.

    Every rank regenerates it locally (the first stage uses tokens, the last targets)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    seqs = torch.randint(0, shape.vocab, (num_microbatches, micro_batch_size, shape.seq_len + 1),
                         generator=g)
    return [(seqs[j, :, :-1].contiguous(), seqs[j, :, 1:].contiguous()) for j in range(num_microbatches)]


def make_optimizer(params: Iterable[nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """The runtime's and the reference's optimizer (per-tensor loops: identical arithmetic
    however the parameters are grouped across stages)."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=False, fused=False)
    raise ConfigError(f"optimizer: unknown optimizer {name!r} (choose 'sgd' or 'adam')")


def scale_loss(loss: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """The quantity whose gradient is accumulated: mean over micro-batches."""
    return loss / num_microbatches


@dataclass
class ReferenceStep:
    losses: list[float]
    grads: dict[str, torch.Tensor]


@dataclass
class ReferenceRun:
    losses: list[list[float]]  # per iteration, per micro-batch
    params: dict[str, torch.Tensor]  # after the last optimizer step
    last_grads: dict[str, torch.Tensor]  # gradients of the last iteration


def _step(model: TinyGPT, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for tokens, targets in batches:  # full backward per micro-batch, in micro-batch order
        loss = model(tokens, targets)
        scale_loss(loss, len(batches)).backward()
        losses.append(float(loss.detach()))
    return losses


def reference_step(shape: ModelShape, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   seed: int) -> ReferenceStep:
    """Single-process losses and accumulated gradients of one step from the seeded model."""
    model = build_full_model(shape, seed)
    losses = _step(model, batches)
    return ReferenceStep(losses, {n: p.grad.detach().clone() for n, p in model.named_parameters()})


def reference_train(shape: ModelShape, micro_batch_size: int, num_microbatches: int, iterations: int,
                    seed: int, optimizer: str = "sgd", lr: float = 0.1) -> ReferenceRun:
    """Single-process training run with the runtime's data, loss scaling and optimizer."""
    model = build_full_model(shape, seed)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    all_losses, grads = [], {}
    for it in range(iterations):
        batches = make_microbatches(shape, micro_batch_size, num_microbatches, seed, it)
        all_losses.append(_step(model, batches))
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return ReferenceRun(all_losses, params, grads)


def params_digest(named: dict[str, torch.Tensor]) -> str:
    """sha256 over names and raw bytes, in name order (bitwise equality check)."""
    h = hashlib.sha256()
    for name in sorted(named):
        t = named[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
