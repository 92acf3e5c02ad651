"""Activation memory by module: the bytes each module of a Megatron-LM layer saves for its
backward, per token, on one tensor-parallel rank, for the kernel stack the launch runs
(:mod:`.stack`). Derived from the modules Megatron-LM runs (``ParallelTransformerLayer`` with
flash attention), one entry per saved tensor; ``tests/common/test_megatron_activations.py``
re-states each stack's layer as its code runs it and checks every entry against the storages
autograd saves (``torch.autograd.graph.saved_tensors_hooks``), with and without sequence
parallelism, at tp 1 and 2.

Per token (bf16 = 2 B; t = tp; h hidden, f ffn, kv the key/value width, d the head dim, a heads):

- ``norm1``, ``norm2``: a fused norm (apex / Transformer Engine) saves its input (2h) and fp32
  statistics (LayerNorm mean + rstd 8 B, RMSNorm rstd 4 B). The LLaMA fork's plain RMSNorm
  (``RMSNorm._norm(x.float()).type_as(x) * weight``) saves the fp32 copy of its input (4h: pow
  and the rstd product keep it), rstd (4 B) and the bf16 normalised output the weight multiply
  keeps (2h); its bf16 input is not saved. With SP the norm runs on the rank's s/t tokens.
- ``qkv``: the column-parallel linear's input (the norm output, 2h; with SP Megatron saves the
  rank's shard, 2h/t, and all-gathers it again in the backward).
- ``rotary``: the plain ``apply_rotary_pos_emb`` keeps cos and sin (bf16, d each) for q and for
  k: 8d, whole; the fused kernel keeps only the fp32 angle table, one storage shared by every
  layer of the stage (4d per token per micro-batch: left out, under 0.1 % of a layer).
- ``attention``: flash attention's q (2h/t), k and v (2kv/t each; GQA shrinks them), its output
  (2h/t; the output projection saves the same storage) and log-sum-exp (fp32, 4a/t).
- ``dropout_attn``, ``dropout_mlp``: the bias-dropout-add masks (1 B x h; h/t with SP), only
  when hidden dropout > 0 (at 0 ``F.dropout`` returns its input; attention dropout inside flash
  attention keeps a seed, not a mask).
- ``fc1``: the column-parallel input (2h, 2h/t with SP).
- ``activation``: GeLU (fused bias-GeLU or not) keeps the fc1 output (2f/t); the plain SwiGLU
  (``torch.chunk``, ``F.silu(a) * b``) keeps the gate-and-up output of width 2f (4f/t: SiLU
  keeps a, the product keeps b, one storage) and the SiLU output (2f/t); the fused SwiGLU
  (Megatron-Core ``SwiGLUFunction``) keeps only its input (4f/t).
- ``fc2``: the row-parallel input, the activation output (2f/t).

Recompute: ``selective`` checkpoints the attention core (its log-sum-exp is recomputed; q, k, v
stay as the checkpoint's inputs and the output as the projection's input); ``full`` keeps each
layer's input (2h, 2h/t with SP) and one layer's working set during its recompute.
First stage: token ids (int64, 8 B; learned positions also position ids) and the embedding
dropout mask (h, h/t with SP) when dropout > 0. Last stage: the final norm (as ``norm1``) and the
output layer's input (2h, 2h/t with SP); the logits are priced apart (``logits_bytes`` per
element). The unfused attention path (s x s scores) is not priced: a stack naming it fails.
"""
from __future__ import annotations

from typing import Optional

from impl.common.api import ConfigError

from .model import MegatronModel
from .stack import Activation, AttentionImpl, KernelStack, Norm, NormImpl

BF16 = 2.0
FP32 = 4.0


def _stack(model: MegatronModel, stack: Optional[KernelStack]) -> KernelStack:
    ks = stack or model.stack
    if ks.attention != AttentionImpl.FLASH:
        raise ConfigError(f"stack.attention: {ks.attention} (the s x s softmax path) is not priced; "
                          f"the step model prices flash attention")
    return ks


def norm_bytes(model: MegatronModel, stack: KernelStack) -> float:
    """Bytes per token one norm saves (whole; divide by tp under SP)."""
    h = model.hidden
    if stack.norm_impl == NormImpl.TORCH_FP32:
        return FP32 * h + FP32 + BF16 * h  # fp32 input copy, rstd, bf16 normalised output
    return BF16 * h + (8.0 if stack.norm == Norm.LAYERNORM else 4.0)


def layer_bytes(model: MegatronModel, tp: int, sequence_parallel: bool = False, dropout: float = 0.0,
                recompute: str = "none", stack: Optional[KernelStack] = None) -> dict:
    """Bytes per token saved by each module of one layer on one TP rank (see the module doc);
    ``recompute`` none or selective (full: :func:`full_recompute_bytes`); ``stack``: the
    model's unless given."""
    ks = _stack(model, stack)
    h, f, kv = model.hidden, model.ffn_hidden, model.kv_hidden
    heads = model.heads
    t = float(tp)
    sp = t if sequence_parallel else 1.0
    if ks.activation == Activation.GELU:
        activation = BF16 * f / t
    else:
        activation = BF16 * (2 if ks.activation_fused else 3) * f / t
    out = {
        "norm1": norm_bytes(model, ks) / sp,
        "qkv": BF16 * h / sp,
        "attention": BF16 * (2 * h + 2 * kv) / t + (0.0 if recompute == "selective" else 4.0 * heads / t),
        "norm2": norm_bytes(model, ks) / sp,
        "fc1": BF16 * h / sp,
        "activation": activation,
        "fc2": BF16 * f / t,
    }
    if ks.rope and not ks.rope_fused:
        out["rotary"] = 4 * BF16 * (h // heads)
    if dropout > 0:
        out["dropout_attn"] = 1.0 * h / sp
        out["dropout_mlp"] = 1.0 * h / sp
    return out


def full_recompute_bytes(model: MegatronModel, tp: int, sequence_parallel: bool = False) -> float:
    """Bytes per token a layer keeps under full recompute: its input."""
    return BF16 * model.hidden / (tp if sequence_parallel else 1)


def embedding_bytes(model: MegatronModel, tp: int, sequence_parallel: bool = False, dropout: float = 0.0,
                    stack: Optional[KernelStack] = None) -> dict:
    """Bytes per token the first stage's embedding saves."""
    out = {"token_ids": 8.0}
    if not _stack(model, stack).rope:
        out["position_ids"] = 8.0
    if dropout > 0:
        out["dropout_embedding"] = 1.0 * model.hidden / (tp if sequence_parallel else 1)
    return out


def head_bytes(model: MegatronModel, tp: int, sequence_parallel: bool = False,
               stack: Optional[KernelStack] = None) -> dict:
    """Bytes per token the last stage saves besides the logits: the final norm and the output
    layer's input."""
    sp = tp if sequence_parallel else 1
    return {"final_norm": norm_bytes(model, _stack(model, stack)) / sp, "output_layer": BF16 * model.hidden / sp}


def per_token_layer(model: MegatronModel, tp: int, sequence_parallel: bool = False, dropout: float = 0.0,
                    recompute: str = "none", stack: Optional[KernelStack] = None) -> float:
    """Total bytes per token of one layer (no recompute or selective)."""
    return float(sum(layer_bytes(model, tp, sequence_parallel, dropout, recompute, stack).values()))


def korthikanti_coefficients(model: MegatronModel, dropout: float = None) -> tuple[float, float]:
    """The derived per-layer bytes as Korthikanti's ``whole * h + sharded * h / tp`` (no SP):
    the coefficients (whole, sharded) per token and hidden unit (dropout: the model's)."""
    h = model.hidden
    dropout = model.dropout if dropout is None else dropout
    one = per_token_layer(model, 1, False, dropout)
    two = per_token_layer(model, 2, False, dropout)
    sharded = 2.0 * (one - two)
    return (one - sharded) / h, sharded / h
