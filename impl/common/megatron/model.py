"""What a Megatron-LM launch is made of: the model as Megatron builds it (GPT or LLaMA), the
static layout of one launch, and the exact parameter count of every (tensor, pipeline) rank.

The counts follow Megatron-LM's own modules (``ParallelTransformerLayer``, ``VocabParallelEmbedding``,
``ColumnParallelLinear`` / ``RowParallelLinear``): a column-parallel weight and its bias are split
over tp, a row-parallel weight is split and its bias is whole on every TP rank, norms are whole.
``tests/common/test_megatron_model.py`` checks them against the per-rank counts Megatron printed
in the H100 runs file (``impl/common/megatron/data/``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from impl.common.api import ConfigError

from .stack import DEFAULT_BY_ARCH, Activation, KernelStack, Norm, named_stack

ARCHS = ("gpt", "llama")
MODES = ("pad", "pack")
RECOMPUTE = ("none", "selective", "full")


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of ``divisible_by * tp`` (``_vocab_size_with_padding``)."""
    m = divisible_by * tp
    return int(math.ceil(vocab / m) * m)


@dataclass(frozen=True)
class MegatronModel:
    """A decoder as Megatron builds it. GPT: LayerNorm, GELU MLP of ``ffn_hidden``, learned
    positions, biases, embeddings tied to the output layer. LLaMA: RMSNorm, SwiGLU MLP of
    ``ffn_hidden`` (fc1 holds gate and up), rotary positions (no table), no biases, optional
    grouped-query attention, untied output layer. ``stack``: how those modules are implemented
    (:class:`.stack.KernelStack`), which sets what they save and how many HBM passes they cost."""

    arch: str = "gpt"
    num_layers: int = 32
    hidden: int = 4096
    ffn_hidden: int = 16384
    heads: int = 32
    kv_heads: int = 0  # 0 = heads (multi-head attention)
    vocab: int = 50257  # the tokenizer's size; Megatron pads it (padded_vocab)
    max_position_embeddings: int = 4096  # GPT's learned position table
    untie_embeddings: Optional[bool] = None  # None: the stack's (GPT fork tied, LLaMA fork untied)
    make_vocab_size_divisible_by: Optional[int] = None  # None: the stack's (128 in both forks)
    # Hidden dropout (bias-dropout-add, embedding): its masks are saved for backward. None: the
    # stack's (GPT fork 0.1, LLaMA fork 0.0).
    hidden_dropout: Optional[float] = None
    name: str = ""
    # The kernels the launch runs (:mod:`.stack`); None: the fork's stack of the architecture.
    stack: Optional[KernelStack] = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"model.arch: unknown {self.arch!r} (one of: {', '.join(ARCHS)})")
        for f in ("num_layers", "hidden", "ffn_hidden", "heads", "vocab"):
            if getattr(self, f) < 1:
                raise ConfigError(f"model.{f}: must be >= 1, got {getattr(self, f)}")
        if self.hidden % self.heads:
            raise ConfigError(f"model.heads: {self.heads} does not divide hidden {self.hidden}")
        if self.kv_heads and self.heads % self.kv_heads:
            raise ConfigError(f"model.kv_heads: {self.kv_heads} does not divide heads {self.heads}")
        if self.stack is None:
            object.__setattr__(self, "stack", DEFAULT_BY_ARCH[self.arch])
        # The parameter counts below follow the architecture; a stack of the other one would
        # price kernels the model does not have.
        if ((self.stack.norm == Norm.RMSNORM) == self.gpt or self.stack.rope == self.gpt
                or (self.stack.activation == Activation.SWIGLU) == self.gpt):
            raise ConfigError(f"model.stack: {self.stack.name} ({self.stack.norm}, {self.stack.activation}, "
                              f"{self.stack.position_embedding}) is not a {self.arch} stack")
        if self.make_vocab_size_divisible_by is None:
            object.__setattr__(self, "make_vocab_size_divisible_by", self.stack.vocab_divisible_by)

    @property
    def gpt(self) -> bool:
        return self.arch == "gpt"

    @property
    def tied(self) -> bool:
        return not (self.untie_embeddings if self.untie_embeddings is not None else self.stack.untie_embeddings)

    @property
    def dropout(self) -> float:
        return self.hidden_dropout if self.hidden_dropout is not None else self.stack.hidden_dropout

    @property
    def kv_hidden(self) -> int:
        return self.hidden // self.heads * (self.kv_heads or self.heads)

    @classmethod
    def from_shape(cls, shape, *, arch: Optional[str] = None, context: int = 0,
                   stack: Optional[str] = None) -> "MegatronModel":
        """The harness's :class:`~impl.common.workloads.pipeline.ModelShape` as Megatron builds it
        (``ffn_hidden`` > 0 means LLaMA, else GPT with ``ffn_mult * hidden``); ``stack`` names the
        kernels it runs (:data:`.stack.STACKS`; None: the shape's ``megatron_stack``, else the fork's
        stack of the architecture)."""
        llama = bool(getattr(shape, "ffn_hidden", 0))
        named = getattr(shape, "megatron_stack", "")
        ks = named_stack(stack) if stack else (named_stack(named, "model.megatron_stack") if named else None)
        return cls(arch=arch or ("llama" if llama else "gpt"), num_layers=shape.num_layers, hidden=shape.hidden,
                   ffn_hidden=shape.ffn_hidden if llama else shape.ffn_mult * shape.hidden, heads=shape.heads,
                   kv_heads=getattr(shape, "kv_heads", 0), vocab=shape.vocab,
                   max_position_embeddings=max(context, shape.seq_len), name=getattr(shape, "name", ""), stack=ks)

    # ---- parameters ---------------------------------------------------------------------
    def layer_matrix_params(self) -> int:
        """Weight-matrix parameters of one whole layer (what the GEMMs multiply by)."""
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_hidden
        mlp = (3 if not self.gpt else 2) * h * f
        return h * (h + 2 * kv) + h * h + mlp

    def layer_params_per_tp_rank(self, tp: int) -> int:
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_hidden
        qkv = h * (h + 2 * kv)
        if self.gpt:
            col = (qkv + (h + 2 * kv)) + (h * f + f)  # QKV and fc1 weights and biases
            row = h * h + f * h  # proj and fc2 weights
            whole = 2 * h + 4 * h  # proj and fc2 biases; two LayerNorms (weight + bias)
        else:
            col = qkv + h * 2 * f  # QKV; fc1 = gate and up
            row = h * h + f * h
            whole = 2 * h  # two RMSNorms
        return (col + row) // tp + whole

    def params_per_rank(self, tp: int, pp: int) -> list[int]:
        """Parameters of each pipeline rank's TP shard, as Megatron prints them."""
        if self.num_layers % pp:
            raise ConfigError(f"layout.pp: {pp} stages cannot split {self.num_layers} layers evenly "
                              f"(Megatron needs num_layers % pp == 0)")
        v = padded_vocab(self.vocab, tp, self.make_vocab_size_divisible_by)
        h = self.hidden
        emb = v // tp * h + (self.max_position_embeddings * h if self.gpt else 0)
        final_norm = 2 * h if self.gpt else h
        out = []
        for s in range(pp):
            n = self.num_layers // pp * self.layer_params_per_tp_rank(tp)
            if s == 0:
                n += emb
            if s == pp - 1:
                n += final_norm
                if not self.tied or pp > 1:  # untied head, or the tied copy on the last stage
                    n += v // tp * h
            out.append(n)
        return out

    def total_params(self) -> int:
        return sum(self.params_per_rank(1, 1))


@dataclass(frozen=True)
class MegatronLayout:
    """One static launch: dp x tp x pp GPUs, micro-batch ``mbs`` sequences, global batch ``gbs``
    sequences of ``context`` tokens, ``mode`` pad (every document padded or cut to the context)
    or pack (a micro-batch's documents concatenated into one variable-length row)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    mbs: int = 1
    gbs: int = 512
    context: int = 4096
    mode: str = "pad"
    sequence_parallel: bool = False
    recompute: str = "none"
    distributed_optimizer: bool = True
    gpus_per_node: int = 8
    # DeepSpeed-Ulysses sequence parallelism inside each replica (instead of TP): every GPU of the
    # group runs 1/ulysses of the tokens through whole layers and all-to-alls heads for attention.
    ulysses: int = 1

    def __post_init__(self) -> None:
        for f in ("dp", "tp", "pp", "mbs", "gbs", "context", "gpus_per_node", "ulysses"):
            if getattr(self, f) < 1:
                raise ConfigError(f"layout.{f}: must be >= 1, got {getattr(self, f)}")
        if self.mode not in MODES:
            raise ConfigError(f"layout.mode: unknown {self.mode!r} (one of: {', '.join(MODES)})")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"layout.recompute: unknown {self.recompute!r} (one of: {', '.join(RECOMPUTE)})")
        if self.gbs % (self.dp * self.mbs):
            raise ConfigError(f"layout.gbs: {self.gbs} is not a multiple of dp x mbs = {self.dp * self.mbs}")
        if self.tp > self.gpus_per_node and self.tp % self.gpus_per_node:
            raise ConfigError(f"layout.tp: {self.tp} spans nodes of {self.gpus_per_node} GPUs unevenly")
        if self.ulysses > 1 and self.tp > 1:
            raise ConfigError(f"layout.ulysses: {self.ulysses} with tp {self.tp} (Ulysses replaces TP: tp must be 1)")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.ulysses

    @property
    def group(self) -> int:
        """GPUs that split one layer's work: the TP or the Ulysses group."""
        return self.tp * self.ulysses

    @property
    def microbatches(self) -> int:
        """Micro-batches per data-parallel rank and iteration."""
        return self.gbs // (self.dp * self.mbs)

    def with_(self, **kw) -> "MegatronLayout":
        return replace(self, **kw)

    def check(self, model: MegatronModel) -> None:
        if self.ulysses > 1 and model.heads % self.ulysses:
            raise ConfigError(f"layout.ulysses: {self.ulysses} does not divide the {model.heads} attention heads")
        if model.heads % self.tp:
            raise ConfigError(f"layout.tp: {self.tp} does not divide the {model.heads} attention heads")
        if model.kv_heads and model.kv_heads % self.tp and self.tp % model.kv_heads:
            raise ConfigError(f"layout.tp: {self.tp} and {model.kv_heads} key/value heads do not divide")
        if model.num_layers % self.pp:
            raise ConfigError(f"layout.pp: {self.pp} stages cannot split {model.num_layers} layers evenly")
