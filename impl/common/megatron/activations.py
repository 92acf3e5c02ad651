"""Activation memory by module: the bytes each module of a Megatron-LM layer saves for its
backward, per token, on one tensor-parallel rank. Derived from the modules Megatron-LM runs
(``ParallelTransformerLayer`` with flash attention, ``transformer_impl local``) for GPT and LLaMA,
one entry per saved tensor; ``tests/common/test_megatron_activations.py`` checks every entry
against the storages autograd saves (``torch.autograd.graph.saved_tensors_hooks``) on a faithful
CPU layer of each architecture, with and without sequence parallelism.

Per token (bf16 = 2 B; t = tp; h hidden, f ffn, kv the key/value width, d the head dim, a heads):

- ``norm1``, ``norm2``: the norm's input (2h) and its fp32 statistics (LayerNorm mean + rstd 8 B,
  RMSNorm rstd 4 B); with SP the norm runs on the rank's s/t tokens.
- ``qkv``: the column-parallel linear's input (the norm output, 2h; with SP Megatron saves the
  rank's shard, 2h/t, and all-gathers it again in the backward).
- ``rotary`` (LLaMA): cos and sin of the positions (bf16, d each) for q and for k: 8d, whole.
- ``attention``: flash attention's q (2h/t), k and v (2kv/t each; GQA shrinks them), its output
  (2h/t; the output projection saves the same storage) and log-sum-exp (fp32, 4a/t).
- ``dropout_attn``, ``dropout_mlp``: the bias-dropout-add masks (1 B x h; h/t with SP), only
  when hidden dropout > 0 (attention dropout inside flash attention keeps a seed, not a mask).
- ``fc1``: the column-parallel input (2h, 2h/t with SP).
- ``activation``: GPT's fused bias-GeLU keeps the fc1 output (2f/t); LLaMA's SwiGLU keeps the
  gate-and-up output of width 2f (4f/t) and the SiLU output (2f/t).
- ``fc2``: the row-parallel input, the activation output (2f/t).

Recompute: ``selective`` checkpoints the attention core (its log-sum-exp is recomputed; q, k, v
stay as the checkpoint's inputs and the output as the projection's input); ``full`` keeps each
layer's input (2h, 2h/t with SP) and one layer's working set during its recompute.
First stage: token ids (int64, 8 B; GPT also position ids) and the embedding dropout mask (h, h/t
with SP) when dropout > 0. Last stage: the final norm (input + statistics) and the output layer's
input (2h, 2h/t with SP); the logits are priced apart (``logits_bytes`` per element).
"""
from __future__ import annotations

from .model import MegatronModel

BF16 = 2.0


def layer_bytes(model: MegatronModel, tp: int, sequence_parallel: bool = False, dropout: float = 0.0,
                recompute: str = "none") -> dict:
    """Bytes per token saved by each module of one layer on one TP rank (see the module doc);
    ``recompute`` none or selective (full: :func:`full_recompute_bytes`)."""
    h, f, kv = model.hidden, model.ffn_hidden, model.kv_hidden
    heads = model.heads
    t = float(tp)
    sp = t if sequence_parallel else 1.0
    stats = 8.0 if model.gpt else 4.0
    out = {
        "norm1": (BF16 * h + stats) / sp,
        "qkv": BF16 * h / sp,
        "attention": BF16 * (2 * h + 2 * kv) / t + (0.0 if recompute == "selective" else 4.0 * heads / t),
        "norm2": (BF16 * h + stats) / sp,
        "fc1": BF16 * h / sp,
        "activation": BF16 * f / t if model.gpt else BF16 * 3 * f / t,
        "fc2": BF16 * f / t,
    }
    if not model.gpt:
        out["rotary"] = 4 * BF16 * (h // heads)
    if dropout > 0:
        out["dropout_attn"] = 1.0 * h / sp
        out["dropout_mlp"] = 1.0 * h / sp
    return out


def full_recompute_bytes(model: MegatronModel, tp: int, sequence_parallel: bool = False) -> float:
    """Bytes per token a layer keeps under full recompute: its input."""
    return BF16 * model.hidden / (tp if sequence_parallel else 1)


def embedding_bytes(model: MegatronModel, tp: int, sequence_parallel: bool = False, dropout: float = 0.0) -> dict:
    """Bytes per token the first stage's embedding saves."""
    out = {"token_ids": 8.0}
    if model.gpt:
        out["position_ids"] = 8.0
    if dropout > 0:
        out["dropout_embedding"] = 1.0 * model.hidden / (tp if sequence_parallel else 1)
    return out


def head_bytes(model: MegatronModel, tp: int, sequence_parallel: bool = False) -> dict:
    """Bytes per token the last stage saves besides the logits: the final norm and the output
    layer's input."""
    sp = tp if sequence_parallel else 1
    stats = 8.0 if model.gpt else 4.0
    return {"final_norm": (BF16 * model.hidden + stats) / sp, "output_layer": BF16 * model.hidden / sp}


def per_token_layer(model: MegatronModel, tp: int, sequence_parallel: bool = False, dropout: float = 0.0,
                    recompute: str = "none") -> float:
    """Total bytes per token of one layer (no recompute or selective)."""
    return float(sum(layer_bytes(model, tp, sequence_parallel, dropout, recompute).values()))


def korthikanti_coefficients(model: MegatronModel, dropout: float = None) -> tuple[float, float]:
    """The derived per-layer bytes as Korthikanti's ``whole * h + sharded * h / tp`` (no SP):
    the coefficients (whole, sharded) per token and hidden unit (dropout: the model's)."""
    h = model.hidden
    dropout = model.dropout if dropout is None else dropout
    one = per_token_layer(model, 1, False, dropout)
    two = per_token_layer(model, 2, False, dropout)
    sharded = 2.0 * (one - two)
    return (one - sharded) / h, sharded / h
