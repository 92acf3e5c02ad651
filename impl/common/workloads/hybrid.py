"""Workload for hybrid-parallel (DP x TP x PP) training on a GPU cluster (Malleus, Elastor,
Hydraulis, ...): the cluster shape, the nominal layout, the global batch, the memory profile
the planner's memory rows use, and the real-mode padding of Malleus's CPU runs
(impl/malleus/README.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from impl.common.workloads.pipeline import ModelShape


@dataclass
class HybridModelShape(ModelShape):
    """The shared transformer shape; LLaMA-like when ffn_hidden > 0 (SwiGLU), GPT otherwise
    (what the tiny real-mode model is). Longer default sequence than the pipeline demo."""

    seq_len: int = 64


@dataclass
class HybridMemory:
    """The planner's per-GPU memory rows (the memory constraint of Malleus's planner, the authors'
    code Hetu `python/hetu/engine/strategy.py`: k_d = state + act x min(d, inflight_cap) per layer,
    E on the first / last stage, X, capacity C), all from the Megatron step model's
    memory terms at the nominal TP degree (:func:`impl.common.parallel.cost.memory_model`)."""

    enabled: bool = False
    # Megatron sequence parallelism: off [R] (the authors' 70B tp8 profile, 1231 + 416 d MB, is the
    # no-SP reading of the step model within 13%: 1392 + 434 d).
    sequence_parallel: bool = False
    # C = memory - headroom; null = the step model's allocatable bytes (fitted or carried).
    headroom_mb: Optional[float] = None
    inflight_cap: int = 0  # 0 = no cap


@dataclass
class HybridWorkload:
    kind: str = "hybrid"
    model: HybridModelShape = field(default_factory=HybridModelShape)
    num_gpus: int = 4
    gpus_per_node: int = 1
    dp: int = 2
    tp: int = 1
    pp: int = 2
    global_batch_size: int = 16
    micro_batch_size: int = 1
    dtype: str = "bf16"
    # TP-shrink slowdowns alpha_k (k = 0..log2 tp); empty = from the cost model (sim) or
    # [1, 2, 4, 8] (real).
    alpha: List[float] = field(default_factory=list)
    memory: HybridMemory = field(default_factory=HybridMemory)
    iterations: int = 20
    warmup_iterations: int = 2
    # Real mode: per layer and micro-batch, forward / backward compute is padded (sleep) to
    # these times, times the GPU's slowdown factor (Malleus's real CPU mode [R],
    # impl/malleus/README.md). 0 = unpadded.
    layer_fwd_pad_s: float = 0.0
    layer_bwd_pad_s: float = 0.0
    # Sim: a profiled forward + backward time of one layer per micro-batch at the nominal TP
    # degree (a fidelity job's per-layer profile); null = the Megatron step model's layer time.
    sim_layer_time_s: Optional[float] = None
    # Sim: a pipeline's fill + drain. "spec" (Malleus's reconstructed cost model [R],
    # impl/malleus/README.md; every paper figure): (m + S - 1) x the
    # slowest stage; "stagewise": max over stages j of m t_j + sum_{k<j} t_k, the 1F1B critical
    # path through the bottleneck stage (equal to "spec" when stages are equal; lower when the
    # bottleneck is early, e.g. a straggler on stage 0 whose bubble the later stages hide).
    pipeline_bubble: str = "spec"
    optimizer: str = "adam"
    lr: float = 1e-3
    torch_threads: int = 1

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


def as_pipeline(wl):
    """The pipeline view of a hybrid workload (one pipeline of ``pp`` stages, replicated ``dp``
    times, ``tp`` wide): the same model, micro-batch and global batch, for pipeline-schedule
    systems (ADAPTRA, ZB, 1F1B) on the shared hybrid workloads of the cross-paper presets. A
    pipeline workload comes back as it is."""
    from impl.common.api import ConfigError
    from impl.common.workloads.pipeline import ModelShape, PipelineWorkload

    if getattr(wl, "kind", None) != "hybrid":
        return wl
    per_pipeline = wl.dp * wl.micro_batch_size
    if wl.global_batch_size % per_pipeline:
        raise ConfigError(f"workload.global_batch_size {wl.global_batch_size} is not a multiple of "
                          f"dp*micro_batch_size = {wl.dp}*{wl.micro_batch_size}")
    m = wl.model
    model = ModelShape(name=m.name, num_layers=m.num_layers, hidden=m.hidden, heads=m.heads, ffn_mult=m.ffn_mult,
                       ffn_hidden=m.ffn_hidden, vocab=m.vocab, seq_len=m.seq_len, kv_heads=m.kv_heads)
    # Real mode's padding: a pipeline op covers a stage's layers for one micro-batch (forward
    # = F, backward = B + W = 2 op pads), so per-layer pads map onto one op pad only when the
    # backward pad is twice the forward one.
    op_pad = 0.0
    if wl.layer_fwd_pad_s or wl.layer_bwd_pad_s:
        if m.num_layers % wl.pp:
            raise ConfigError(f"workload.pp: {wl.pp} does not divide model.num_layers {m.num_layers} "
                              f"(per-layer pads need equal stages)")
        if abs(wl.layer_bwd_pad_s - 2 * wl.layer_fwd_pad_s) > 1e-12:
            raise ConfigError(f"workload.layer_bwd_pad_s: a pipeline op pads backward as 2x forward; got "
                              f"{wl.layer_bwd_pad_s} vs 2 x {wl.layer_fwd_pad_s}")
        op_pad = wl.layer_fwd_pad_s * (m.num_layers // wl.pp)
    return PipelineWorkload(model=model, stages=wl.pp, dp=wl.dp, tp=wl.tp, micro_batch_size=wl.micro_batch_size,
                            num_microbatches=wl.global_batch_size // per_pipeline, dtype=wl.dtype,
                            iterations=wl.iterations, warmup_iterations=wl.warmup_iterations, op_pad_s=op_pad,
                            torch_threads=wl.torch_threads)
