"""The kernel stack a Megatron-LM launch runs, as data: which norm and how it is implemented,
which MLP activation and whether it is fused, how positions are embedded, dropout, the attention
kernel, the optimizer's sharding, the gradient-accumulation dtype, the output layer's tying and
the vocabulary padding. Activation memory (:mod:`.activations`) and the memory-bound time of the
step model (:func:`.step.elementwise_bytes`) follow it: an unfused op saves its own tensors and
costs its own HBM passes.

Named stacks, each read from the code that runs it:

- ``megatron_gpt_fork``: the February H100 GPT launches, https://github.com/Sakura-gh/Megatron-LM
  branch ``sync_files`` (``megatron/model/fused_layer_norm.py`` apex ``FusedLayerNormAffineFunction``,
  ``megatron/model/fused_bias_gelu.py`` ``bias_gelu_impl``, ``megatron/model/transformer.py``
  ``bias_dropout_add_fused_train`` with hidden and attention dropout 0.1, learned positions, flash
  attention, tied embeddings; the launches' printed arguments).
- ``megatron_llama_fork``: the same fork's branch ``llama`` with ``transformer_impl local``:
  ``megatron/model/rms_norm.py`` (``RMSNorm._norm(x.float()).type_as(x) * weight``: plain PyTorch
  in fp32), ``megatron/model/transformer.py`` ``ParallelMLP`` (``torch.chunk`` then
  ``F.silu(a) * b``), ``megatron/core/models/common/embeddings/rotary_pos_embedding.py``
  ``apply_rotary_pos_emb`` (``t * cos + rotate_half(t) * sin``, plain PyTorch), no dropout,
  untied output layer.
- ``megatron_llama_fused``: LLaMA as Megatron-Core runs it with ``transformer_impl
  transformer_engine`` (https://github.com/NVIDIA/Megatron-LM ``megatron/core/models/gpt/gpt_layer_specs.py``
  ``TELayerNormColumnParallelLinear``: the norm fused into the next linear;
  ``megatron/core/fusions/fused_bias_swiglu.py`` ``SwiGLUFunction`` saves only its input;
  ``rotary_pos_embedding.apply_rotary_pos_emb(fused=True)``, Transformer Engine's fused RoPE).

A launch's stack comes from Megatron's printed arguments (:func:`stack_from_args`); a workload's
model names one with ``megatron_stack`` (``impl/common/workloads/pipeline.ModelShape``; every
``MegatronModel.from_shape`` reads it), and ``from_shape(..., stack=)`` / ``grid.model_of(wl,
stack=)`` override it, so a system can price its baseline "as its paper ran it" and itself "as its
authors' code runs it".
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Mapping

from impl.common.api import ConfigError


class Norm(StrEnum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class NormImpl(StrEnum):
    FUSED = "fused"  # one apex / Transformer Engine kernel each way: saves input + fp32 statistics
    TORCH_FP32 = "torch_fp32"  # plain PyTorch ops on an fp32 copy of the input (the fork's RMSNorm)


class Activation(StrEnum):
    GELU = "gelu"
    SWIGLU = "swiglu"


class PositionEmbedding(StrEnum):
    LEARNED = "learned"
    ROPE = "rope"


class AttentionImpl(StrEnum):
    FLASH = "flash"
    UNFUSED = "unfused"  # the s x s softmax path: not priced by the step model


class GradDtype(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"


@dataclass(frozen=True)
class KernelStack:
    """What one launch's code runs (see the module doc)."""

    name: str = "custom"
    norm: Norm = Norm.LAYERNORM
    norm_impl: NormImpl = NormImpl.FUSED
    activation: Activation = Activation.GELU
    activation_fused: bool = True
    position_embedding: PositionEmbedding = PositionEmbedding.LEARNED
    rope_fused: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    attention: AttentionImpl = AttentionImpl.FLASH
    distributed_optimizer: bool = True
    grad_accum_dtype: GradDtype = GradDtype.FP32
    untie_embeddings: bool = False
    vocab_divisible_by: int = 128

    def __post_init__(self) -> None:
        for f, enum in (("norm", Norm), ("norm_impl", NormImpl), ("activation", Activation),
                        ("position_embedding", PositionEmbedding), ("attention", AttentionImpl),
                        ("grad_accum_dtype", GradDtype)):
            v = getattr(self, f)
            if v not in set(enum):
                raise ConfigError(f"stack.{f}: unknown {v!r} (one of: {', '.join(e.value for e in enum)})")
            object.__setattr__(self, f, enum(v))
        for f in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, f) < 1.0:
                raise ConfigError(f"stack.{f}: must be in [0, 1), got {getattr(self, f)}")
        if self.vocab_divisible_by < 1:
            raise ConfigError(f"stack.vocab_divisible_by: must be >= 1, got {self.vocab_divisible_by}")
        if self.norm == Norm.LAYERNORM and self.norm_impl == NormImpl.TORCH_FP32:
            raise ConfigError("stack.norm_impl: torch_fp32 is the fork's RMSNorm; no code path runs LayerNorm so")

    @property
    def grad_bytes(self) -> float:
        """Bytes of one parameter's gradient buffer (Megatron's main_grad)."""
        return 4.0 if self.grad_accum_dtype == GradDtype.FP32 else 2.0

    @property
    def rope(self) -> bool:
        return self.position_embedding == PositionEmbedding.ROPE

    def with_(self, **kw) -> "KernelStack":
        return replace(self, **kw)


MEGATRON_GPT_FORK = KernelStack(name="megatron_gpt_fork")
MEGATRON_LLAMA_FORK = KernelStack(
    name="megatron_llama_fork", norm=Norm.RMSNORM, norm_impl=NormImpl.TORCH_FP32, activation=Activation.SWIGLU,
    activation_fused=False, position_embedding=PositionEmbedding.ROPE, rope_fused=False, hidden_dropout=0.0,
    attention_dropout=0.0, untie_embeddings=True)
MEGATRON_LLAMA_FUSED = MEGATRON_LLAMA_FORK.with_(name="megatron_llama_fused", norm_impl=NormImpl.FUSED,
                                                 activation_fused=True, rope_fused=True)

STACKS: dict[str, KernelStack] = {s.name: s for s in (MEGATRON_GPT_FORK, MEGATRON_LLAMA_FORK, MEGATRON_LLAMA_FUSED)}
DEFAULT_BY_ARCH = {"gpt": MEGATRON_GPT_FORK, "llama": MEGATRON_LLAMA_FORK}


def named_stack(name: str, field: str = "megatron_stack") -> KernelStack:
    try:
        return STACKS[name]
    except KeyError:
        raise ConfigError(f"{field}: unknown stack {name!r} (one of: {', '.join(STACKS)})") from None


def _flag(args: Mapping, key: str, default):
    v = args.get(key)
    return default if v is None else v


def stack_from_args(args: Mapping) -> KernelStack:
    """The stack of a launch from Megatron's printed arguments; an absent key takes the fork's
    default (``megatron/arguments.py`` on branch ``llama``: LayerNorm, no swiglu, learned absolute
    positions, dropout 0.1, tied embeddings, ``transformer_impl local``, no flash attention, no
    distributed optimizer, bias-GeLU fusion on, vocabulary multiple 128; bf16 forces fp32
    gradient accumulation)."""
    te = _flag(args, "transformer_impl", "local") == "transformer_engine"
    rms = str(_flag(args, "normalization", "LayerNorm")) == "RMSNorm"
    rope = (str(_flag(args, "position_embedding_type", "learned_absolute")) == "rope"
            or bool(_flag(args, "use_rotary_position_embeddings", False)))
    swiglu = bool(_flag(args, "swiglu", False))
    fp32_grads = bool(_flag(args, "accumulate_allreduce_grads_in_fp32", False)) or bool(_flag(args, "bf16", False))
    got = KernelStack(
        name="printed",
        norm=Norm.RMSNORM if rms else Norm.LAYERNORM,
        # The local path's LayerNorm is apex's fused kernel, its RMSNorm plain PyTorch.
        norm_impl=NormImpl.TORCH_FP32 if rms and not te else NormImpl.FUSED,
        activation=Activation.SWIGLU if swiglu else Activation.GELU,
        # The local path fuses bias-GeLU (bias_gelu_fusion, default on) and never SwiGLU.
        activation_fused=te or (not swiglu and bool(_flag(args, "bias_gelu_fusion", True))),
        position_embedding=PositionEmbedding.ROPE if rope else PositionEmbedding.LEARNED,
        rope_fused=rope and (te or bool(_flag(args, "apply_rope_fusion", False))),
        hidden_dropout=float(_flag(args, "hidden_dropout", 0.1)),
        attention_dropout=float(_flag(args, "attention_dropout", 0.1)),
        attention=AttentionImpl.FLASH if (te or bool(_flag(args, "use_flash_attn", False))) else AttentionImpl.UNFUSED,
        distributed_optimizer=bool(_flag(args, "use_distributed_optimizer", False)),
        grad_accum_dtype=GradDtype.FP32 if fp32_grads else GradDtype.BF16,
        untie_embeddings=bool(_flag(args, "untie_embeddings_and_output_weights", False)),
        vocab_divisible_by=int(_flag(args, "make_vocab_size_divisible_by", 128)),
    )
    # A printed stack that is a named one carries its name (and its citation).
    return next((s for s in STACKS.values() if replace(s, name=got.name) == got), got)
