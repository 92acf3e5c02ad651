"""Workload for pipeline-parallel training (ADAPTRA, Malleus, HotSPa, ... reuse it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ModelShape:
    """The one transformer shape: the cost models (sim), the tiny GPT builder (real training)
    and the tiny Llama builder (real serving) all read it. Build it with keywords."""

    name: str = "gpt-tiny"
    num_layers: int = 8
    hidden: int = 64
    heads: int = 4
    ffn_mult: int = 4
    # > 0: LLaMA-style SwiGLU MLP of this width (3 matrices); 0: GPT MLP of ffn_mult * hidden.
    ffn_hidden: int = 0
    vocab: int = 256
    # Training: the sequence length; serving: the longest sequence (position table) it takes.
    seq_len: int = 32
    # Key/value heads (grouped-query attention); 0 = heads (multi-head attention).
    kv_heads: int = 0
    # The kernels the Megatron step model prices for this model (a name of
    # impl/common/megatron/stack.STACKS: megatron_gpt_fork, megatron_llama_fork, megatron_llama_fused;
    # empty: the Megatron-LM fork's stack of the architecture). A preset names what its code runs.
    megatron_stack: str = ""

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def kv_hidden(self) -> int:
        """Width of the K (and of the V) projection: hidden * kv_heads / heads."""
        return self.hidden * self.num_kv_heads // self.heads


@dataclass
class PipelineWorkload:
    kind: str = "pipeline"
    model: ModelShape = field(default_factory=ModelShape)
    stages: int = 4
    dp: int = 1
    tp: int = 1
    micro_batch_size: int = 2
    num_microbatches: int = 12
    dtype: str = "fp16"
    iterations: int = 5
    warmup_iterations: int = 2
    # Real mode only: pad every F/B/W op to this many seconds (ADAPTRA's real CPU mode [R],
    # impl/adaptra/README.md: keeps a 2-core CPU
    # compute-bound in a controlled way). 0 = no padding. Recorded in the record's config.
    op_pad_s: float = 0.0
    # Sim only: fixed per-op times override the cost model when set (e.g. the 10 ms ops of
    # the ZB simulator reference, impl/adaptra/README.md).
    sim_op_time_s: Optional[float] = None
    torch_threads: int = 1
